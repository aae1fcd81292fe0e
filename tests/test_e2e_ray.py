"""The OpenAI end-to-end tests (test_e2e.py, the default model through the openai
client) against ``superfluid serve --replicas 2``: two replicas on a local Ray
instance behind one front door."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

import test_e2e  # noqa: E402
from test_e2e import *  # noqa: E402,F401,F403  the same tests, collected again with this module's server


@pytest.fixture(scope="module")
def server():
    yield from test_e2e.start_server("--quant", "none", "--replicas", "2", "--replica-cpus", "0.5")


def test_health_shows_both_replicas(server):
    import httpx

    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and len(h["replicas"]) == 2
    assert all(r["state"] == "up" and r["worker"] == "ok" for r in h["replicas"])
