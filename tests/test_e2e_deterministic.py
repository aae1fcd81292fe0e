"""End to end with ``--deterministic``: a seeded sampled request gives the same text
alone and among 16 concurrent requests (batch-invariant numerics)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from test_e2e import ask, start_server

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client():
    for base in start_server("--deterministic"):
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def test_deterministic_alone_and_among_16(client):
    kw = dict(temperature=0.8, seed=77, max_tokens=8)
    alone = ask(client, "Invent a name for a cat.", **kw).choices[0].message.content
    others = [f"Tell me fact number {i} about space." for i in range(15)]
    with cf.ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(ask, client, q, temperature=0.8, seed=i, max_tokens=8) for i, q in enumerate(others)]
        mine = pool.submit(ask, client, "Invent a name for a cat.", **kw)
        crowd = mine.result().choices[0].message.content
        for f in futs:
            f.result()
    assert crowd == alone
