"""Handover by export/adopt between two engines, without Ray: a running request is
detached from one engine (its KV published and exported) and adopted by another, which
continues it from that KV -- decode-replaying only the tokens past the last whole page --
to exactly the text it would have had. Also a resume with no KV (a lost replica):
tokens decode-replayed, same rng base, same text."""

from __future__ import annotations

import pytest

from superfluid.cluster.handover import adopt_choices, hand_over
from superfluid.engine.config import EngineConfig
from superfluid.engine.loader import build_engine
from superfluid.engine.params import SamplingParams
from superfluid.engine.request import ChoiceStart, rng_base

PROMPT = list(range(5, 47))
PARAMS = SamplingParams(max_tokens=40, temperature=0.9, seed=11, n=2, ignore_eos=True)


def _step(engine) -> list:
    engine.step()
    return engine.output.take()


def _run(engine, rid, prompt, params, choices=None, until=None) -> dict[int, list]:
    """Deltas per choice (text, tokens) until the request finished or ``until`` tokens."""
    got = {}
    engine.add_request(rid, prompt, params, choices)
    while engine.has_work():
        engine.step()
        for d in engine.output.take():
            text, toks, fin = got.get(d.index, ("", [], None))
            got[d.index] = (text + d.text, toks + d.token_ids, d.finish_reason or fin)
        if until is not None and all(len(v[1]) >= until for v in got.values()) and len(got) == params.n:
            break
    return got


@pytest.fixture(scope="module", params=["toy", "toy-worker", "torch-worker"])
def engines(request, tmp_path_factory):
    if request.param == "torch-worker":
        # a tiny random Llama: the payload holds K/V tensors, which cross the worker wire encoded
        from superfluid_testing.tiny import TinyModel

        path = TinyModel().write_gguf(tmp_path_factory.mktemp("handover") / "tiny.gguf")
        config = EngineConfig(runtime="torch", model=str(path), worker=True)
    else:
        config = EngineConfig(runtime="toy", model="toy", worker=request.param == "toy-worker")
    made = [build_engine(config) for _ in range(4)]  # a reference, two for a handover, one fresh
    yield made
    for e in made:
        e.close()


def test_a_handed_over_request_continues_from_the_exported_kv(engines):
    ref_engine, a, b, _ = engines
    want = _run(ref_engine, "ref", PROMPT, PARAMS)
    assert all(len(v[1]) == 40 for v in want.values())

    part = _run(a, "r", PROMPT, PARAMS, until=13)
    handed = hand_over(a, ["r"])["r"]
    assert sorted(c.index for c in handed.choices) == [0, 1]
    for c in handed.choices:
        assert c.token_ids == part[c.index][1]  # what went out is what is handed over
        assert c.prefix is not None and len(c.prefix[0]) > len(PROMPT)  # the KV of prompt and generated tokens
    assert not a.has_work()  # nothing of the request stays behind

    hits_before = b.scheduler.stats.prefix_hit_tokens
    starts = adopt_choices(b, handed.choices, PROMPT)
    assert all(s.lease is not None for s in starts)
    rest = _run(b, "r", PROMPT, PARAMS, starts)
    for i in (0, 1):
        assert part[i][0] + rest[i][0] == want[i][0]
        assert part[i][1] + rest[i][1] == want[i][1]
        assert rest[i][2] == "length"
    adopted = sum(len(c.prefix[0]) for c in handed.choices)
    assert b.scheduler.stats.prefix_hit_tokens - hits_before == adopted  # started from the KV, not recomputed


def test_a_lost_request_resumes_by_decode_replay_with_the_same_rng_base(engines):
    ref_engine, _, lost, fresh = engines
    want = _run(ref_engine, "ref2", PROMPT, PARAMS)
    part = _run(lost, "r2", PROMPT, PARAMS, until=9)
    lost.abort("r2")
    # that replica is gone: only what the client saw survives, and the fresh one has no cache
    starts = [ChoiceStart(i, rng_base(PARAMS.seed, i), tuple(part[i][1])) for i in (0, 1)]
    rest = _run(fresh, "r2", PROMPT, PARAMS, starts)
    assert fresh.scheduler.stats.prefix_hit_tokens == 0
    for i in (0, 1):
        assert part[i][0] + rest[i][0] == want[i][0]
        assert part[i][1] + rest[i][1] == want[i][1]


def test_text_held_back_for_a_stop_string_survives_the_move(engines):
    """The old replica held back text that might start a stop string; the client never
    got it. The new replica re-processes the replayed tokens, holds the same text, and
    releases it once the stop string cannot match: nothing is lost or doubled."""
    ref_engine, _, _, fresh = engines
    plain = SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True)
    pieces = []
    ref_engine.add_request("pieces", PROMPT, plain)
    while ref_engine.has_work():
        pieces += [d.text for d in _step(ref_engine) if d.token_ids]  # one per token
    assert len(pieces) == 30
    # a stop string the text runs along from token 8 to 13, then leaves
    stop = "".join(pieces[8:14]) + "\x00"
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True, stop=(stop,))
    seen = []  # (token, text released with it), as a client streams them
    ref_engine.add_request("stop-ref", PROMPT, params)
    while ref_engine.has_work():
        seen += [(d.token_ids, d.text) for d in _step(ref_engine)]  # the last: no token, the tail
    want = "".join(t for _, t in seen)
    assert want.startswith("".join(pieces[:14]))  # never matched: all of it, in the end
    # the replica is lost after 12 tokens: the client has their tokens, not all their text
    part_tokens = [t for ids, _ in seen[:12] for t in ids]
    part_text = "".join(x for _, x in seen[:12])
    assert len(part_tokens) == 12 and len(part_text) < len("".join(pieces[:12]))
    rest = _run(fresh, "stop", PROMPT, params, [ChoiceStart(0, rng_base(5, 0), tuple(part_tokens))])[0]
    assert part_text + rest[0] == want
    assert part_tokens + rest[1] == [t for ids, _ in seen for t in ids]
