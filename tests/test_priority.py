"""Priority scheduling (vLLM's semantics, preemption, aging) through ``LLM``'s engine on
the toy runtime, and through a real ``superfluid serve`` with the openai client."""

from __future__ import annotations

import asyncio
import time

import pytest

from superfluid import LLM, SamplingParams
from superfluid.engine.config import SchedulerConfig
from superfluid.engine.params import ParamError

LOW = SamplingParams(temperature=0.8, seed=4, max_tokens=60, ignore_eos=True, priority=5)
HIGH = SamplingParams(temperature=0.8, seed=9, max_tokens=6, ignore_eos=True, priority=0)


def drive(eng, got: dict, events: list, steps: int | None = None) -> None:
    n = 0
    while eng.has_work() and (steps is None or n < steps):
        n += 1
        eng.step()
        for d in eng.output.take():
            got.setdefault(d.request_id, []).extend(d.token_ids)
            if d.token_ids and len(got[d.request_id]) == len(d.token_ids):
                events.append(("first", d.request_id))
            if d.finish_reason:
                events.append(("finish", d.request_id))


@pytest.mark.parametrize("limit", ["batch", "pool"])
def test_a_better_priority_preempts_the_worst_running_lane_which_ends_with_its_text(limit):
    if limit == "batch":
        llm = LLM(runtime="toy", scheduler=SchedulerConfig(max_running=2))
    else:  # the two low ones fit the pool to their end, but not beside the long high prompt
        llm = LLM(runtime="toy", runtime_args={"n_cells": 208, "page": 8})
    ids = {r: llm.tokenizer.encode(f"request {r}") for r in ("low-a", "low-b")}
    ids["high"] = llm.tokenizer.encode("high " * 30)
    assert limit == "batch" or len(ids["high"]) > 100
    ref = {r: o.outputs[0].token_ids for r, o in zip(
        ["low-a", "low-b"], llm.generate([ids["low-a"], ids["low-b"]], [LOW, LOW.with_(seed=5)]))}
    ref["high"] = llm.generate([ids["high"]], HIGH)[0].outputs[0].token_ids
    eng = llm.engine
    assert eng.scheduler.stats.preemptions == 0  # alone, nothing gives way
    got, events = {}, []
    eng.add_request("low-a", ids["low-a"], LOW)
    eng.add_request("low-b", ids["low-b"], LOW.with_(seed=5))
    drive(eng, got, events, steps=6)
    assert eng.scheduler.num_running == 2 and all(0 < len(got[r]) < 60 for r in ("low-a", "low-b"))
    before = eng.scheduler.stats.preemptions
    eng.add_request("high", ids["high"], HIGH)
    drive(eng, got, events)
    assert eng.scheduler.stats.preemptions > before
    first_high = events.index(("first", "high"))
    assert first_high < events.index(("finish", "low-a")) and first_high < events.index(("finish", "low-b"))
    assert got == ref  # preempted lanes replay to exactly their uninterrupted text


def test_equal_priorities_never_preempt_and_are_served_fcfs():
    llm = LLM(runtime="toy", scheduler=SchedulerConfig(max_running=1))
    eng = llm.engine
    got, events = {}, []
    p = LOW.with_(priority=0, max_tokens=10)
    eng.add_request("a", llm.tokenizer.encode("a"), p)
    drive(eng, got, events, steps=2)
    eng.add_request("b", llm.tokenizer.encode("b"), p)
    eng.add_request("c", llm.tokenizer.encode("c"), p)
    drive(eng, got, events)
    assert [r for k, r in events if k == "finish"] == ["a", "b", "c"]
    assert eng.scheduler.stats.preemptions == 0


def test_aging_lets_an_old_low_priority_request_overtake_newcomers():
    def order(aging: float) -> list[str]:
        llm = LLM(runtime="toy", scheduler=SchedulerConfig(max_running=1, priority_aging_s=aging))
        eng = llm.engine
        got, events = {}, []
        p = LOW.with_(max_tokens=4)
        eng.add_request("running", llm.tokenizer.encode("r"), p.with_(priority=0))
        drive(eng, got, events, steps=1)
        eng.add_request("old-low", llm.tokenizer.encode("o"), p.with_(priority=10))
        time.sleep(0.3)
        eng.add_request("new-high", llm.tokenizer.encode("n"), p.with_(priority=0))
        drive(eng, got, events)
        return [r for k, r in events if k == "finish"]

    assert order(0.0) == ["running", "new-high", "old-low"]
    assert order(0.01) == ["running", "old-low", "new-high"]  # 0.3 s waited: 30 levels better


def test_fcfs_ignores_order_by_priority_and_refuses_a_priority():
    llm = LLM(runtime="toy", scheduling_policy="fcfs")
    assert llm.engine.scheduler.policy.kind == "fcfs"
    with pytest.raises(ParamError, match="priority scheduling is not enabled") as e:
        llm.generate(["x"], SamplingParams(priority=3))
    assert e.value.param == "priority"
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        LLM(runtime="toy", scheduling_policy="lifo")


# ------------------------------------------------------------------ the server


def test_server_priority_preempts_into_a_full_batch():
    """``--scheduling-policy priority --max-batch 2``: two low-priority streams fill the
    batch; a high-priority request gets its first token before either finishes, and both
    still end with the text each has alone. Under fcfs a priority is a 400."""
    from openai import AsyncOpenAI, BadRequestError, OpenAI

    from serve_helpers import Server

    async def stream(client, prompt, priority, seed, max_tokens, log, name):
        text = ""
        s = await client.completions.create(
            model="toy", prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=seed, stream=True,
            extra_body={"priority": priority, "ignore_eos": True},
        )
        async for chunk in s:
            piece = chunk.choices[0].text if chunk.choices else ""
            if piece and not text:
                log.append(("first", name, time.monotonic()))
            text += piece
        log.append(("finish", name, time.monotonic()))
        return text

    async def scenario(base):
        client = AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
        alone = {}
        for name, seed in (("low-a", 1), ("low-b", 2)):
            alone[name] = await stream(client, f"prompt {name}", 5, seed, 120, [], name)
        log = []
        lows = [asyncio.create_task(stream(client, f"prompt {n}", 5, s, 120, log, n)) for n, s in (("low-a", 1), ("low-b", 2))]
        while sum(1 for e in log if e[0] == "first") < 2:
            await asyncio.sleep(0.01)
        high = await stream(client, "prompt high", 0, 3, 5, log, "high")
        texts = await asyncio.gather(*lows)
        return alone, dict(zip(["low-a", "low-b"], texts)), high, log

    s = Server("--scheduling-policy", "priority", "--max-batch", "2", "--runtime-arg", "step_delay=0.01")
    try:
        alone, texts, high, log = asyncio.run(asyncio.wait_for(scenario(s.v1), 120))
    except BaseException:
        print(s.log())
        raise
    finally:
        s.cleanup()
    assert texts == alone and high
    at = {(k, n): t for k, n, t in log}
    assert at[("first", "high")] < at[("finish", "low-a")] and at[("first", "high")] < at[("finish", "low-b")], log

    s = Server("--scheduling-policy", "fcfs")
    try:
        client = OpenAI(base_url=s.v1, api_key="x", max_retries=0)
        with pytest.raises(BadRequestError) as e:
            client.completions.create(model="toy", prompt="x", max_tokens=2, extra_body={"priority": 1})
        assert "priority scheduling is not enabled" in e.value.message and e.value.body["param"] == "priority"
        assert client.completions.create(model="toy", prompt="x", max_tokens=2).choices[0].finish_reason == "length"
    finally:
        s.cleanup()
