"""The llamacpp runtime: any GGUF llama.cpp loads, through its low-level C API (DESIGN §4)."""

from __future__ import annotations

__all__ = ["load_runtime"]


def load_runtime(model=None, **kwargs):
    """A LlamaCppRuntime for ``model`` (a registered name or a .gguf file)."""
    from ...models import DEFAULT_MODEL
    from .runtime import LlamaCppRuntime

    return LlamaCppRuntime(model if model is not None else DEFAULT_MODEL, **kwargs)
