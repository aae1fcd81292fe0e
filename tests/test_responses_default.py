"""A stored conversation on the default model (the quantized route, batch- and
path-invariant): three seeded turns over ``previous_response_id`` give the text of the
same turns sent as whole chat histories, turns 2 and 3 start from the leased prefix
(cached tokens), and after a server restart between turns 2 and 3 the third turn, its KV
gone, is prefilled again and gives the same text."""

from __future__ import annotations

import pytest

from serve_helpers import Server

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
TURNS = ["Name a color of the sky.", "Why is it that color?", "Say it again in five words."]
SAMPLING = dict(temperature=0.7, seed=42)


def _server(state_dir) -> Server:
    return Server("--state-dir", str(state_dir), runtime="torch", ready_timeout=180)


def _client(s: Server):
    return openai.OpenAI(base_url=s.v1, api_key="none", max_retries=0, timeout=300)


def _turn(client, text: str, previous):
    return client.responses.create(model=MODEL, input=text, max_output_tokens=24, temperature=SAMPLING["temperature"],
                                   previous_response_id=previous.id if previous else None,
                                   extra_body={"seed": SAMPLING["seed"]})


def test_three_turns_equal_chat_histories_lease_their_prefix_and_survive_a_restart(tmp_path):
    s = _server(tmp_path)
    try:
        client = _client(s)
        responses, r = [], None
        for text in TURNS:  # first, on a fresh server: nothing but the conversation is cached
            r = _turn(client, text, r)
            responses.append(r)
        messages, chat = [], []
        for text in TURNS:
            messages.append({"role": "user", "content": text})
            c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **SAMPLING)
            chat.append(c.choices[0].message.content)
            messages.append({"role": "assistant", "content": chat[-1]})
    finally:
        s.cleanup()
    assert all(chat) and [r.output_text for r in responses] == chat
    cached = [r.usage.input_tokens_details.cached_tokens for r in responses]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached
    assert all(r.status in ("completed", "incomplete") for r in responses)

    s = _server(tmp_path)  # a restart: the store is on disk, the KV is gone
    try:
        client = _client(s)
        assert client.responses.retrieve(responses[0].id).output_text == responses[0].output_text
        again = _turn(client, TURNS[2], responses[1])
    finally:
        s.cleanup()
    assert again.output_text == responses[2].output_text
    assert again.usage.input_tokens == responses[2].usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == 0  # prefilled again
