"""``superfluid serve --replicas 3`` on the toy runtime, through Ray, driven by the
openai client: prefix-aware routing keeps a conversation on one replica, a replica
killed mid-stream costs no stream any text, a drained replica's requests finish
elsewhere from its exported KV with identical text.

One server (and so one local Ray instance) for the module; the toy's logits are a
function of the token history, so a seeded stream's text is the same on any replica.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from serve_helpers import Server  # noqa: E402

MODEL = "toy"
N_STREAMS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # step_delay: every runtime step takes 10 ms, so that streams are still running
    # when a replica is killed or drained
    s = Server("--replicas", "3", "--replica-cpus", "0.5", "--runtime-arg", "step_delay=0.01", "--state-dir",
               str(tmp_path_factory.mktemp("state")), ready_timeout=180)
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=120)


def _prompt(i: int) -> str:
    return f"stream {i}: tell me a story about the number {i * 7919} " * 3


async def _streams(server, n: int, during=None, max_tokens: int = 48) -> list[str]:
    """n concurrent seeded streams; ``during`` runs once they are all under way."""
    ac = openai.AsyncOpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=120)
    started = [asyncio.Event() for _ in range(n)]

    async def one(i: int) -> str:
        text, got = "", 0
        stream = await ac.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=max_tokens, temperature=0.9,
                                             seed=i, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            assert chunk.choices, chunk
            text += chunk.choices[0].text
            got += 1
            if got == 4:
                started[i].set()
        started[i].set()
        return text

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    if during is not None:
        await asyncio.gather(*(e.wait() for e in started))
        await asyncio.to_thread(during)
    return list(await asyncio.gather(*tasks))


@pytest.fixture(scope="module")
def reference(client):
    """Each stream's text, alone and undisturbed."""
    out = []
    for i in range(N_STREAMS):
        r = client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=48, temperature=0.9, seed=i,
                                      extra_body={"ignore_eos": True})
        out.append(r.choices[0].text)
    return out


def _routed(server) -> dict[str, dict]:
    return {r["name"]: r for r in server.health()["replicas"]}


def test_health_and_metrics_show_every_replica(server, client):
    h = server.health()
    assert h["status"] == "ok" and [r["name"] for r in h["replicas"]] == ["replica-0", "replica-1", "replica-2"]
    assert len({r["pid"] for r in h["replicas"]}) == 3 and all(r["state"] == "up" for r in h["replicas"])
    assert [m.id for m in client.models.list().data] == [MODEL]
    metrics = httpx.get(server.base + "/metrics").text
    for name in ("replica-0", "replica-1", "replica-2"):
        assert f'superfluid_cluster_replica_load{{replica="{name}"}}' in metrics
        assert f'superfluid_cluster_replica_up{{replica="{name}"}} 1.0' in metrics


def test_bad_input_gets_an_openai_error_at_the_door(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)


def test_a_conversation_stays_on_one_replica_and_its_cached_tokens_grow(server, client):
    before = _routed(server)
    messages = [{"role": "system", "content": "You are a careful assistant who answers in toy words. " * 2}]
    cached = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: what comes after {turn}?"})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    after = _routed(server)
    grew = {n: after[n]["routed"].get("prefix_hit", 0) - before[n]["routed"].get("prefix_hit", 0) for n in after}
    assert sorted(grew.values()) == [0, 0, 3], grew  # turns 2-4 followed turn 1's pages
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
    metrics = httpx.get(server.base + "/metrics").text
    assert 'superfluid_cluster_routed_requests_total{replica=' in metrics and 'route="prefix_hit"' in metrics


def test_prompt_cache_key_pins_a_replica(server, client):
    before = _routed(server)
    for i in range(4):
        client.completions.create(model=MODEL, prompt=f"unrelated prompt {i} " * 4, max_tokens=2,
                                  extra_body={"prompt_cache_key": "tenant-42"})
    after = _routed(server)
    grew = {n: after[n]["routed"].get("cache_key", 0) - before[n]["routed"].get("cache_key", 0) for n in after}
    assert sorted(grew.values()) == [0, 0, 4], grew


def test_a_stored_conversation_routes_every_turn_to_the_replica_holding_its_prefix(server, client):
    """previous_response_id carries the conversation's cache key: every turn goes where the key hashes."""
    before = _routed(server)
    r, cached = None, []
    for turn in range(3):
        r = client.responses.create(model=MODEL, input=f"Question {turn}: and then what happened?", temperature=0,
                                    max_output_tokens=12, previous_response_id=r.id if r else None)
        cached.append(r.usage.input_tokens_details.cached_tokens)
    after = _routed(server)
    grew = {n: after[n]["routed"].get("cache_key", 0) - before[n]["routed"].get("cache_key", 0) for n in after}
    assert sorted(grew.values()) == [0, 0, 3], grew
    assert cached[1] > cached[0] and cached[2] > cached[1], cached


def test_killing_a_replica_actor_leaves_every_stream_its_text(server, reference):
    victim = {}

    def kill() -> None:
        loads = {r["name"]: (r["load"], r["pid"]) for r in server.health()["replicas"]}
        name = max(loads, key=lambda n: loads[n][0])
        victim.update(name=name, load=loads[name][0])
        os.kill(loads[name][1], signal.SIGKILL)  # the actor's process: its engine and worker go with it

    texts = asyncio.run(_streams(server, N_STREAMS, during=kill))
    assert victim["load"] > 0
    for i, (got, want) in enumerate(zip(texts, reference)):
        assert got == want, f"stream {i}"
    metrics = httpx.get(server.base + "/metrics").text
    assert _metric(metrics, "superfluid_cluster_failovers_total") >= victim["load"]
    deadline = time.monotonic() + 60  # Ray restarts the actor; the front door takes it back
    while time.monotonic() < deadline:
        if server.health()["status"] == "ok":
            break
        time.sleep(0.5)
    h = server.health()
    assert h["status"] == "ok" and h["restarts"] >= 1, h


def test_a_drained_replica_hands_its_requests_over_with_identical_text(server, reference):
    drained = {}

    def drain() -> None:
        loads = {r["name"]: r["load"] for r in server.health()["replicas"]}
        name = max(loads, key=loads.get)
        r = httpx.post(f"{server.base}/v1/cluster/replicas/{name}/drain", timeout=60)
        assert r.status_code == 200, r.text
        drained.update(r.json())

    texts = asyncio.run(_streams(server, N_STREAMS, during=drain))
    assert drained["handed_over"] > 0
    for i, (got, want) in enumerate(zip(texts, reference)):
        assert got == want, f"stream {i}"
    metrics = httpx.get(server.base + "/metrics").text
    assert _metric(metrics, "superfluid_cluster_handovers_total") == drained["handed_over"]
    h = server.health()
    states = {r["name"]: r["state"] for r in h["replicas"]}
    assert states[drained["replica"]] == "removed" and h["status"] == "ok"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_sigterm_on_a_replica_hands_its_requests_over_with_identical_text(server):
    """SIGTERM (a node drained, a pod stopped) on a replica's process: before it exits,
    its running requests move by export/adopt (handovers, not failovers) and every
    stream keeps its text. Long streams (about 3 s), so that they are still running when
    the signal lands; Ray alone would let them finish there before exiting."""
    n, long = 8, 240
    reference = asyncio.run(_streams(server, n, max_tokens=long))  # undisturbed (the toy's text is the history's)
    before = httpx.get(server.base + "/metrics").text
    handovers0 = _metric(before, "superfluid_cluster_handovers_total")
    failovers0 = _metric(before, "superfluid_cluster_failovers_total")
    victim = {}

    def term() -> None:
        live = [r for r in server.health()["replicas"] if r["state"] == "up"]
        r = max(live, key=lambda r: r["load"])
        victim.update(name=r["name"], load=r["load"])
        os.kill(r["pid"], signal.SIGTERM)

    texts = asyncio.run(_streams(server, n, during=term, max_tokens=long))
    assert victim["load"] > 0
    for i, (got, want) in enumerate(zip(texts, reference)):
        assert got == want, f"stream {i}"
    after = httpx.get(server.base + "/metrics").text
    assert _metric(after, "superfluid_cluster_handovers_total") - handovers0 >= 1, after
    assert _metric(after, "superfluid_cluster_failovers_total") - failovers0 <= victim["load"]
