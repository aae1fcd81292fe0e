"""The torch runtime: our own Llama-family forward over a paged KV pool (DESIGN §4)."""

from __future__ import annotations

from .runtime import TorchRuntime

__all__ = ["TorchRuntime", "load_runtime"]


def load_runtime(model=None, **kwargs) -> TorchRuntime:
    """A TorchRuntime for ``model`` (a registered name, a .gguf file or an HF folder)."""
    from ...models import DEFAULT_MODEL

    return TorchRuntime(model if model is not None else DEFAULT_MODEL, **kwargs)
