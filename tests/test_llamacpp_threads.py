"""llama.cpp's OpenMP threads spin briefly, then sleep, between decodes
(superfluid/runtimes/llamacpp/__init__.py says why): after a decode an idle process burns
well under libgomp's default ~5 ms of CPU, the environment is left as it was, and an
explicit OMP_WAIT_POLICY still wins. Each case is a fresh process (libgomp reads its
environment once, when it loads)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")

from superfluid_testing.tiny import TinyModel  # noqa: E402

PROBE = r"""
import os, sys, time
from superfluid.runtimes.registry import build_runtime
from superfluid.runtimes.base import Feed
rt = build_runtime("llamacpp", model=sys.argv[1], n_threads=2, n_ctx=512)
s = rt.seq_create()
rt.step([Feed(s, list(range(1, 40)), True)])
c0 = time.process_time()
time.sleep(0.3)
print((time.process_time() - c0) * 1e3, os.environ.get("OMP_WAIT_POLICY", os.environ.get("GOMP_SPINCOUNT", "-")))
"""


def _idle_cpu_ms(path, **env) -> tuple[float, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ms, policy = out.stdout.split()[-2:]
    return float(ms), policy


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return TinyModel(tied=False, seed=4).write_gguf(tmp_path_factory.mktemp("lcthreads") / "llama.gguf")


def test_threads_spin_briefly_after_a_decode(gguf):
    ms, policy = _idle_cpu_ms(gguf)
    # Spinning threads burn most of the 300 ms (up to 600 ms on two); a quiet process takes a
    # few ms, more on a loaded machine (3.1 ms seen in a full suite run): 10 ms tells them apart.
    assert ms < 10.0, f"{ms:.1f} ms of CPU in 300 ms idle after a decode: llama.cpp's threads spin on"
    assert policy == "-"  # set for libgomp's load only


def test_an_explicit_policy_wins(gguf):
    ms, policy = _idle_cpu_ms(gguf, OMP_WAIT_POLICY="ACTIVE")
    assert policy == "ACTIVE" and ms > 20.0  # ACTIVE spins through the idle time (a share of it on a busy machine)
