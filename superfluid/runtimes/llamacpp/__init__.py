"""The llamacpp runtime: any GGUF llama.cpp loads, through its low-level C API (DESIGN §4).

Importing this package loads llama-cpp-python (when installed) with libgomp's spin count
cut from 300,000 to ``SPIN_COUNT`` (``GOMP_SPINCOUNT``, unless the environment sets it or
``OMP_WAIT_POLICY``). Why: llama.cpp's CPU backend runs each graph in one OpenMP parallel
region and every op boundary is an OpenMP barrier. At libgomp's default a thread that waits
spins ~5 ms before it sleeps, so between two decodes llama.cpp's threads hold the cores the
rest of the serving path needs (the executor's Python, the daemon, the clients), and on a
busy machine a barrier spins while the thread it waits for is descheduled. 30,000 spins
(~0.5 ms) still cover a barrier inside a decode; ``PASSIVE`` (no spinning) would not: every
barrier would sleep and wake, and a token took 3x longer (35 vs 12 ms on 2 cores).
libgomp reads the variable once, when it is loaded, so it is set for that load only and
put back after: the process's other OpenMP users (torch ships its own libgomp) and its
children keep their own.
"""

from __future__ import annotations

import os
import sys

__all__ = ["load_runtime"]

SPIN_COUNT = os.environ.get("SUPERFLUID_GOMP_SPINCOUNT", "30000")


def _load_llama_cpp() -> None:
    if "llama_cpp" in sys.modules:
        return  # loaded already: libgomp has read its environment
    mine = not ({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ))
    if mine:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pass  # an optional extra: whoever needs it reports its absence
    finally:
        if mine:
            os.environ.pop("GOMP_SPINCOUNT", None)


_load_llama_cpp()


def load_runtime(model=None, **kwargs):
    """A LlamaCppRuntime for ``model`` (a registered name or a .gguf file)."""
    from ...models import DEFAULT_MODEL
    from .runtime import LlamaCppRuntime

    return LlamaCppRuntime(model if model is not None else DEFAULT_MODEL, **kwargs)
