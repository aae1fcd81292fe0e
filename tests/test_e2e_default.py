"""End to end on the default server (no flags): the fast path is the default, and it is
batch- and path-invariant, so a seeded sampled request gives the same text alone, among
16 concurrent requests, and when its prompt comes from the prefix cache."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from test_e2e import ask, start_server

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server():
    yield from start_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def test_default_is_the_quantized_invariant_path(server):
    runtime = httpx.get(server + "/health").json()["runtime"]
    assert runtime.endswith(":det:gguf:Q4_1+Q8_0"), runtime  # the default GGUF: Q4_1 layers, a Q8_0 embedding (the tied head)


def crowd(client, n: int = 15):
    """Other requests at the same time: different prompts, seeds and lengths."""
    pool = cf.ThreadPoolExecutor(n)
    return pool, [pool.submit(ask, client, f"Tell me fact number {i} about space.", temperature=0.8, seed=i,
                              max_tokens=6 + i % 5) for i in range(n)]


def test_seeded_n2_same_text_every_call_cache_hit_and_crowd(client):
    question = "Write a two-line poem about a lighthouse keeper and the sea at night."
    kw = dict(n=2, seed=4242, temperature=0.9, max_tokens=12)
    first = ask(client, question, **kw)
    texts = [c.message.content for c in first.choices]
    assert texts[0] != texts[1]
    again = ask(client, question, **kw)  # its prompt now comes from the prefix cache
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert [c.message.content for c in again.choices] == texts
    pool, others = crowd(client)
    mine = pool.submit(ask, client, question, **kw)
    assert [c.message.content for c in mine.result().choices] == texts
    for f in others:
        f.result()
    pool.shutdown()


def test_seeded_alone_and_among_16(client):
    kw = dict(temperature=0.8, seed=77, max_tokens=8)
    alone = ask(client, "Invent a name for a cat.", **kw).choices[0].message.content
    pool, others = crowd(client)
    mine = pool.submit(ask, client, "Invent a name for a cat.", **kw)
    assert mine.result().choices[0].message.content == alone
    for f in others:
        f.result()
    pool.shutdown()
