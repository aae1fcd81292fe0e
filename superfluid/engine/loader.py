"""Build an engine from an ``EngineConfig``: a small registry of runtimes.

Each builder returns ``(runtime, tokenizer, model_name)``. The torch builder
imports its runtime lazily so that the toy path (tests, CI without weights) never
pays for loading it.
"""

from __future__ import annotations

from typing import Callable

from ..rings import Rings
from .config import EngineConfig
from .engine import Engine


def _toy(config: EngineConfig):
    from ..runtimes.toy import ToyRuntime

    kw = {}
    if config.max_batch:
        kw["max_batch"] = config.max_batch
    if config.kv_cache_mb:
        kw["n_cells"] = max(64, config.kv_cache_mb * (1 << 20) // 64)  # the toy's cell is 64 bytes
    rt = ToyRuntime(**kw)
    return rt, rt.tokenizer, config.model or "toy"


def _torch(config: EngineConfig):
    from ..models import DEFAULT_MODEL
    from ..runtimes.torch import TorchRuntime

    name = config.model or DEFAULT_MODEL
    kw = dict(dtype=config.dtype, deterministic=config.deterministic, progress=config.progress)
    if config.kv_cache_mb:
        kw["kv_cache_mb"] = config.kv_cache_mb
    if config.max_batch:
        kw["max_batch"] = config.max_batch
    rt = TorchRuntime(model=name, **kw)  # resolves the name or path; loads weights and tokenizer
    return rt, rt.tokenizer, name


RUNTIMES: dict[str, Callable] = {"toy": _toy, "torch": _torch}


def build_engine(config: EngineConfig) -> Engine:
    from ..executor import Executor

    builder = RUNTIMES.get(config.runtime)
    if builder is None:
        raise ValueError(f"unknown runtime {config.runtime!r} (choose from {', '.join(RUNTIMES)})")
    runtime, tokenizer, name = builder(config)
    rings = Rings(runtime.desc.vocab_size)
    executor = Executor(runtime, rings)
    return Engine(executor, rings, tokenizer, config, model_name=name)
