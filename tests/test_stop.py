"""Stop strings across token boundaries, and stop token ids through the engine."""

from hypothesis import given, settings
from hypothesis import strategies as st

from superfluid import LLM, SamplingParams
from superfluid.engine.stop import StopChecker


def feed(checker: StopChecker, deltas: list[str]) -> list[str]:
    return [checker.push(d) for d in deltas]


def test_stop_string_split_over_deltas_is_never_released():
    c = StopChecker(["STOP"])
    out = feed(c, ["hello S", "T", "O", "P and more"])
    assert out == ["hello ", "", "", ""]
    assert c.stopped == "STOP"
    assert c.text == "hello "


def test_held_back_text_is_released_when_it_turns_out_not_to_stop():
    c = StopChecker(["STOP"])
    assert c.push("a ST") == "a "
    assert c.push("ART") == "START"
    assert c.push("x S") == "x "
    assert c.flush() == "S"
    assert c.stopped is None


def test_include_stop_string_and_earliest_of_several():
    c = StopChecker(["bc", "ab"], include_in_output=True)
    assert feed(c, ["xa", "bc"]) == ["x", "ab"]
    assert c.stopped == "ab"


def test_stop_inside_one_delta_cuts_the_rest():
    c = StopChecker(["\n\n"])
    assert c.push("line one\n\nline two") == "line one"
    assert c.push("more") == ""


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abc\n", min_size=0, max_size=40),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(min_value=0, max_value=40), max_size=12),
)
def test_released_text_is_the_text_cut_at_the_first_stop(text, stops, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    c = StopChecker(stops)
    released = ""
    for d in deltas:
        released += c.push(d)
        assert not any(s in released for s in stops)
    released += c.flush()
    # Streaming semantics (as vLLM): generation stops at the first delta after which a
    # stop string is complete; the text is cut where the earliest stop in it begins.
    # (A longer stop that begins earlier but is not complete yet does not count.)
    seen = ""
    for d in deltas:
        seen += d
        starts = [seen.find(s) for s in stops if s in seen]
        if starts:
            assert released == seen[: min(starts)]
            return
    assert released == text


def test_engine_stop_strings_and_stop_token_ids():
    llm = LLM(runtime="toy")
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 40
    # A stop string made of text that spans several tokens of the greedy output.
    stop = base.text[5:8]
    first = base.text.find(stop)
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.text == base.text[:first]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    # token ids stop at the token that completed the stop string
    assert base.token_ids[: len(c.token_ids)] == c.token_ids
    assert len(c.token_ids) < 40
    # a stop token id ends it at that token, and its text is not part of the output
    tid = base.token_ids[3]
    c = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[tid]))[0].outputs[0]
    k = base.token_ids.index(tid)
    assert c.token_ids == base.token_ids[: k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == tid
