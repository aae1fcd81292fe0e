"""The llamacpp runtime: any GGUF llama.cpp loads, through its low-level C API (DESIGN §4).

Importing this package loads llama-cpp-python (when installed) with libgomp told to let
its idle threads sleep (``OMP_WAIT_POLICY=PASSIVE``, unless the environment says
otherwise). Why: llama.cpp's CPU backend runs each graph in one OpenMP parallel region,
and libgomp's default keeps the worker threads spinning for a long while after it. Between
two decodes those spinning threads hold the cores the rest of the serving path needs (the
executor's Python, the daemon, the client); on a machine with as many cores as llama.cpp
threads every decode then waits for a descheduled thread at its barriers. libgomp reads the
variable once, when it is loaded, so it is set only for that load and put back after: this
process's other OpenMP users (torch ships its own libgomp) and its children keep theirs.
"""

from __future__ import annotations

import os
import sys

__all__ = ["load_runtime"]

WAIT_POLICY = "PASSIVE"


def _load_llama_cpp() -> None:
    if "llama_cpp" in sys.modules:
        return  # loaded already: libgomp has read its environment
    had = "OMP_WAIT_POLICY" in os.environ
    if not had:
        os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pass  # an optional extra: whoever needs it reports its absence
    finally:
        if not had:
            os.environ.pop("OMP_WAIT_POLICY", None)


_load_llama_cpp()


def load_runtime(model=None, **kwargs):
    """A LlamaCppRuntime for ``model`` (a registered name or a .gguf file)."""
    from ...models import DEFAULT_MODEL
    from .runtime import LlamaCppRuntime

    return LlamaCppRuntime(model if model is not None else DEFAULT_MODEL, **kwargs)
