"""Why a choice failed travels as a code on the Delta (issue 24), and the server maps
codes, never message text, to HTTP statuses."""

from __future__ import annotations

import ast
from pathlib import Path

from superfluid import LLM, SamplingParams
from superfluid.engine.outputs import ErrorCode
from superfluid.server.render import failure

SERVER = Path(__file__).resolve().parent.parent / "superfluid" / "server"


def test_a_failed_callback_and_a_lane_fault_carry_their_codes():
    llm = LLM(runtime="toy")

    def broken(ids, logits):
        raise RuntimeError("boom")

    bad, good = llm.generate(["one", "two"], [SamplingParams(max_tokens=4, logits_processors=[broken]),
                                            SamplingParams(max_tokens=4, temperature=0)])
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].error_code is ErrorCode.CALLBACK_FAILED
    assert "boom" in bad.outputs[0].error
    assert good.outputs[0].error_code is None and good.outputs[0].finish_reason == "length"

    eng = llm.engine
    (req,) = eng.add_request("f", llm.tokenizer.encode("fault me"), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(50):
        if req.lane_tag is not None:
            break
        eng.step()
    assert req.lane_tag is not None, "the request was never admitted"
    eng.ex.inject_fault(req.lane_tag)
    for _ in range(200):
        if not eng.has_work():
            break
        eng.step()
    (last,) = [d for d in eng.output.take() if d.finish_reason]
    assert last.error_code is ErrorCode.LANE_FAULT and last.finish_reason == "error"


def test_codes_map_to_statuses():
    assert (failure(ErrorCode.GRAMMAR_DEAD_END).status, failure(ErrorCode.GRAMMAR_DEAD_END).param) == (400, "response_format")
    assert failure(ErrorCode.DEADLINE).status == 503 and failure(ErrorCode.DEADLINE).code == "deadline_exceeded"
    assert failure(ErrorCode.LANE_FAULT).status == 500 and failure(None).code == "internal_error"


def test_the_server_never_matches_an_error_by_its_text():
    """No comparison in the server reads a delta's or choice's ``error`` text."""
    for path in SERVER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                assert not any(isinstance(s, ast.Attribute) and s.attr == "error" for s in sides), \
                    f"{path.name}:{node.lineno} compares an error message"
