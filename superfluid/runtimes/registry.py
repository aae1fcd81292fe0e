"""Runtimes by name: a small dict registry instead of a plugin system."""

from __future__ import annotations

from typing import Any, Callable

from .base import RuntimePrimitives


def _toy(**kw: Any) -> RuntimePrimitives:
    from .toy import ToyRuntime

    return ToyRuntime(**kw)


def _torch(**kw: Any) -> RuntimePrimitives:
    from .torch import load_runtime

    return load_runtime(**kw)


def _llamacpp(**kw: Any) -> RuntimePrimitives:
    from .llamacpp import load_runtime  # first: it loads llama_cpp with its OpenMP settings

    try:
        import llama_cpp  # noqa: F401  (an optional extra)
    except ImportError as e:
        raise ValueError(f"the llamacpp runtime needs llama-cpp-python (pip install '.[llamacpp]'): {e}") from None

    return load_runtime(**kw)


RUNTIMES: dict[str, Callable[..., RuntimePrimitives]] = {"toy": _toy, "torch": _torch, "llamacpp": _llamacpp}


def build_runtime(kind: str, **kw: Any) -> RuntimePrimitives:
    try:
        make = RUNTIMES[kind]
    except KeyError:
        raise ValueError(f"unknown runtime {kind!r}; known: {', '.join(sorted(RUNTIMES))}") from None
    return make(**kw)
