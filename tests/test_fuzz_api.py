"""schemathesis over the server's own OpenAPI schema, against ``superfluid serve`` (toy
runtime, the model in a supervised worker): no answer is a 5xx (check not_a_server_error),
the worker is never replaced, and /health is ok afterwards.

Bounded for the suite: deterministic generation, SUPERFLUID_FUZZ_EXAMPLES per operation
(default 100; well under a minute here). ``make fuzz`` runs a long randomised search.
tests/fuzz_hooks.py makes every body name the served model, so the fuzzer reaches
validation and generation rather than the 404 of an unknown model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serve_helpers import Server

pytest.importorskip("schemathesis")

TESTS = Path(__file__).resolve().parent


def schemathesis_run(base: str, examples: int, deterministic: bool = True, timeout: float = 600):
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    cmd = [exe, "run", base + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", str(examples),
           "--request-timeout", "60", "--phases", "examples,coverage,fuzzing"]
    cmd += ["--generation-deterministic"] if deterministic else []
    env = dict(os.environ, SCHEMATHESIS_HOOKS="fuzz_hooks",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_fuzzing_the_api_finds_no_5xx_and_no_worker_restart():
    s = Server("--max-request-tokens", "4096", "--max-queued-requests", "64")
    try:
        examples = int(os.environ.get("SUPERFLUID_FUZZ_EXAMPLES", "100"))
        p = schemathesis_run(s.base, examples, deterministic=not os.environ.get("SUPERFLUID_FUZZ_RANDOM"),
                             timeout=float(os.environ.get("SUPERFLUID_FUZZ_TIMEOUT", "600")))
        assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
        # every operation: /tokenize, /detokenize, /v1/models/{id}, /v1/responses (POST, GET, DELETE) too
        assert "passed" in p.stdout and "Selected: 11/11" in p.stdout and "Tested: 11" in p.stdout, p.stdout[-3000:]
        h = httpx.get(s.base + "/health", timeout=10).json()
        assert h["status"] == "ok" and h["restarts"] == 0, h
    finally:
        s.cleanup()
