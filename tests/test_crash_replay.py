"""A crashed worker costs no request and no text (DESIGN §7).

``superfluid serve`` runs as a subprocess with the model in a supervised worker
process; the official ``openai`` client streams 16 concurrent requests (greedy, seeded
sampling, a JSON schema) while the worker is SIGKILLed, fails fatally (exit 70) or
hangs. Every request must complete with exactly the text of an uninterrupted run.
The toy runtime is deterministic and batch-invariant by construction, so the
reference texts hold on any server; the slow variant uses the real model with
``--deterministic``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest

from serve_helpers import Server

openai = pytest.importorskip("openai")

WORDS = "the river runs past old stone walls and green fields under a wide grey sky".split()
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
}


def requests_16(max_tokens: int = 200) -> list[dict]:
    """Greedy, seeded sampling at 0.8, one JSON-schema request; varied lengths."""
    out = []
    for i in range(16):
        rng = random.Random(i)
        content = f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(5 + i))
        kw: dict = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens - 5 * i}
        if i == 15:
            kw.update(temperature=0.8, seed=15, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        elif i % 2 == 0:
            kw.update(temperature=0, extra_body={"ignore_eos": i % 4 == 0})
        else:
            kw.update(temperature=0.8, seed=1000 + i, extra_body={"ignore_eos": i % 4 == 1})
        out.append(kw)
    return out


@dataclass
class Progress:
    """Chunks received over every stream; waiters wake at a count or when all ended."""

    chunks: int = 0
    done: bool = False
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def bump(self) -> None:
        async with self.cond:
            self.chunks += 1
            self.cond.notify_all()

    async def finish(self) -> None:
        async with self.cond:
            self.done = True
            self.cond.notify_all()

    async def reached(self, n: int) -> bool:
        async with self.cond:
            await self.cond.wait_for(lambda: self.chunks >= n or self.done)
            return self.chunks >= n and not self.done


async def stream_one(client, model: str, kw: dict, progress: Progress) -> tuple[str, str]:
    text, finish = [], None
    stream = await client.chat.completions.create(model=model, stream=True, **kw)
    async for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                text.append(c.delta.content)
            if c.finish_reason is not None:
                finish = c.finish_reason
        await progress.bump()
    return "".join(text), finish


async def run_all(base: str, model: str, reqs: list[dict], progress: Progress, timeout: float) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=timeout)
    try:
        return await asyncio.gather(*(stream_one(client, model, kw, progress) for kw in reqs))
    finally:
        await progress.finish()
        await client.close()


async def wait_replaced(http: httpx.AsyncClient, old_pid: int, timeout: float) -> list[str]:
    """Poll /health until a new worker serves (status ok, another pid); returns the
    statuses seen on the way."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = (await http.get("/health")).json()
        seen.append(h["status"])
        if h["status"] == "ok" and h["pid"] not in (None, old_pid):
            return seen
        await asyncio.sleep(0.01)
    raise AssertionError(f"no new worker within {timeout} s: {seen[-5:]}")


async def kill_at(server: Server, progress: Progress, thresholds: list[int], replace_timeout: float) -> list[list[str]]:
    """SIGKILL the worker each time the streams pass a threshold; the next kill waits
    until the replacement serves. Returns /health's statuses around each kill."""
    server_pid = server.proc.pid
    kills = []
    async with httpx.AsyncClient(base_url=server.base, timeout=30) as http:
        for n in thresholds:
            if not await progress.reached(n):
                break
            h = (await http.get("/health")).json()
            assert h["status"] == "ok" and h["pid"] not in (None, server_pid), h
            os.kill(h["pid"], signal.SIGKILL)
            kills.append(await wait_replaced(http, h["pid"], replace_timeout))
    return kills


def run(coro, timeout: float):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def count_chunks(base: str, model: str, reqs: list[dict], timeout: float) -> tuple[list[tuple[str, str]], int]:
    progress = Progress()
    texts = run(run_all(base, model, reqs, progress, timeout), timeout + 30)
    return texts, progress.chunks


# ------------------------------------------------------------------ the toy runtime


# Each toy step sleeps a little, so that generation outlasts the client's reading of
# the streams and a kill at a streamed-chunk count lands while the worker generates.
SLOW_TOY = ("--runtime-arg", "step_delay=0.01", "--max-queued-requests", "512")


@pytest.fixture(scope="module")
def server():
    s = Server(*SLOW_TOY)
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def reference(server):
    """The 16 requests run without interruption: (texts, chunks streamed)."""
    texts, chunks = count_chunks(server.base, "toy", requests_16(), 60)
    assert all(finish in ("stop", "length") for _, finish in texts), texts
    assert any(finish == "length" for _, finish in texts)
    return texts, chunks


def test_sigkilled_worker_costs_no_request_and_no_text(server, reference):
    want, total = reference
    rng = random.Random(20240607)
    thresholds = sorted(rng.sample(range(total // 10, total * 6 // 10), 3))
    first = server.health()
    assert first["pid"] != server.proc.pid

    async def scenario():
        progress = Progress()
        streams = asyncio.create_task(run_all(server.base, "toy", requests_16(), progress, 60))
        kills = await kill_at(server, progress, thresholds, replace_timeout=30)
        return await streams, kills

    log_before = server.log()
    got, kills = run(scenario(), 120)
    assert len(kills) == 3, f"only {len(kills)} kills before the streams ended"
    assert got == want  # every request finished, each with the text of the uninterrupted run
    losses = server.log()[len(log_before):].count("the model worker was lost")
    idle = server.log()[len(log_before):].count("while idle")
    assert losses == 3 and idle == 0, "each kill hit a worker with requests in flight"
    # /health: degraded while a worker was being replaced, ok after, restarts counted
    assert any("degraded" in seen for seen in kills), kills
    h = server.health()
    assert h["status"] == "ok" and h["worker"] == "ok"
    assert h["restarts"] >= first["restarts"] + len(kills) and h["last_exit"] == -signal.SIGKILL


def test_a_worker_killed_while_idle_is_replaced_without_a_request(server, reference):
    """The supervisor replaces a dead worker between requests, so /health recovers."""
    h = server.health()
    os.kill(h["pid"], signal.SIGKILL)

    async def wait():
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as http:
            return await wait_replaced(http, h["pid"], 30)

    seen = run(wait(), 60)
    assert seen[-1] == "ok" and server.health()["restarts"] == h["restarts"] + 1
    texts, _ = count_chunks(server.base, "toy", requests_16()[:4], 60)
    assert texts == reference[0][:4]


# Without the JSON-schema request: each worker that compiles a grammar first imports
# xgrammar (seconds); the SIGKILL test covers grammar replay.
PLAIN = requests_16()[:15]


def failing_server(spec: str, *args: str) -> Server:
    # The failure comes after 40 step calls, mid-run, however fast the toy runs.
    return Server("--max-queued-requests", "512", *args, env={"SUPERFLUID_FAIL_RUNTIME": spec})


@pytest.mark.parametrize("spec", ["step:fatal:1:40", "seq_create:fatal:1:6", "seq_truncate:fatal:1:2"])
def test_a_fatal_runtime_error_exits_70_and_requests_complete(reference, spec):
    """A primitive fails fatally mid-run (a step after 40 good calls; a lane's seq_create,
    which answered FATAL without the fatal exit before; the truncate that cuts a retired lane
    to its cache key, whose Fatal was swallowed before): the worker exits 70, a clean one
    (without the failure) takes over, every text is the reference."""
    s = failing_server(spec)
    try:
        assert s.health()["restarts"] == 0
        texts, _ = count_chunks(s.base, "toy", PLAIN, 60)
        assert texts == reference[0][:15]
        h = s.health()
        assert (h["status"], h["restarts"], h["last_exit"]) == ("ok", 1, 70), h
        # (one restart only: the clean worker did not get the failure injected again)
        log = s.log()
        assert "this worker exits so that the daemon starts a clean one" in log
        assert log.count("the model worker was lost") == 1
    finally:
        s.cleanup()


def test_a_hung_worker_is_detected_and_replaced(reference):
    """A step that never returns: the heartbeat goes on but no runtime call completes;
    after --worker-stall-timeout the supervisor kills the worker and replays."""
    s = failing_server("step:hang:1:40", "--worker-stall-timeout", "2")
    try:
        t0 = time.monotonic()
        texts, _ = count_chunks(s.base, "toy", PLAIN, 60)
        elapsed = time.monotonic() - t0
        assert texts == reference[0][:15]
        h = s.health()
        assert (h["status"], h["restarts"], h["last_exit"]) == ("ok", 1, -signal.SIGKILL), h
        assert "no progress for" in s.log()
        assert elapsed >= 2.0  # the stall was waited out, not skipped
    finally:
        s.cleanup()


def test_a_request_ending_mid_tick_releases_its_handles_after_the_tick():
    """Regression: a request that ends inside a tick (max_tokens reached in a partial
    emit) released its logit-bias handle at once; over a worker, that call took the
    tick's reply for its own and the engine saw a lost worker. Releases now wait for
    the tick's reply."""
    from superfluid.engine.config import EngineConfig
    from superfluid.engine.loader import build_engine
    from superfluid.engine.params import SamplingParams

    engine = build_engine(EngineConfig(runtime="toy", worker=True))
    try:
        finished = {}
        engine.stream_to(lambda d: finished.__setitem__(d.request_id, d.finish_reason) if d.finish_reason else None)
        ids = engine.tokenizer.encode("short and biased")
        engine.add_request("long", engine.tokenizer.encode("a long one"), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        engine.add_request("biased", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={5: 1.0}))
        for _ in range(200):
            if not engine.has_work():
                break
            engine.step()
        assert finished == {"long": "length", "biased": "length"}
        assert engine.ex.restart_count == 0 and engine.ex.state == "ok"
    finally:
        engine.close()


def test_a_worker_lost_while_taking_over_is_replaced_again():
    """Regression: a worker that died while the engine re-registered handles on it
    (right after a restart) failed every request; now the engine starts another."""
    from superfluid.engine.config import EngineConfig
    from superfluid.engine.loader import build_engine
    from superfluid.engine.params import SamplingParams

    engine = build_engine(EngineConfig(runtime="toy", worker=True))
    try:
        texts: dict[str, list[str]] = {}
        finish: dict[str, str] = {}

        def on_delta(d):
            texts.setdefault(d.request_id, []).append(d.text)
            if d.finish_reason:
                finish[d.request_id] = d.finish_reason

        engine.stream_to(on_delta)
        ids = engine.tokenizer.encode("biased and lost twice")
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=60, ignore_eos=True, logit_bias={7: 5.0})

        def run(rid: str, kill_at_step: int | None) -> None:
            engine.add_request(rid, ids, params)
            for step in range(500):
                if not engine.has_work():
                    return
                if step == kill_at_step:
                    engine.ex.kill()
                engine.step()
            raise AssertionError("the request did not finish")

        run("reference", None)
        real_restart = engine.ex.restart

        def restart_then_die():
            real_restart()
            engine.ex.restart = real_restart
            engine.ex.kill()  # dies before the engine re-registers the logit bias on it

        engine.ex.restart = restart_then_die
        run("lost", 3)
        assert finish == {"reference": "length", "lost": "length"}
        assert "".join(texts["lost"]) == "".join(texts["reference"])
        assert engine.ex.restart_count == 2 and engine.ex.state == "ok"
    finally:
        engine.close()


# ------------------------------------------------------------------ the real model


@pytest.mark.slow
def test_sigkilled_torch_worker_replays_to_the_same_text():
    """The same with SmolLM2 on the default (quantized, batch-invariant) path: 2 kills."""
    s = Server(runtime="torch", ready_timeout=300)
    try:
        model = s.health()["model"]
        reqs = [dict(kw, max_tokens=16) for kw in requests_16()[:3]] + [dict(requests_16()[15], max_tokens=16)]
        want, total = count_chunks(s.base, model, reqs, 300)
        assert all(f in ("stop", "length") for _, f in want)
        rng = random.Random(7)
        thresholds = sorted(rng.sample(range(max(1, total // 8), max(3, total // 2)), 2))

        async def scenario():
            progress = Progress()
            streams = asyncio.create_task(run_all(s.base, model, reqs, progress, 300))
            kills = await kill_at(s, progress, thresholds, replace_timeout=120)
            return await streams, kills

        got, kills = run(scenario(), 400)
        assert len(kills) == 2, f"only {len(kills)} kills landed mid-run"
        assert got == want
        assert s.health()["status"] == "ok"
        assert s.stop() == 0
        assert "Segfault" not in s.log()  # the worker exits cleanly too
    finally:
        s.cleanup()
