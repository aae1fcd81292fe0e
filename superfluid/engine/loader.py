"""Build an engine from an ``EngineConfig``.

The runtime runs either in this process (``LLM``, tests) or in a worker process
(``superfluid serve``; DESIGN §7): then the executor is a ``WorkerClient`` proxy,
the rings are shared memory, and a worker that dies is replaced and its requests
replayed (``Engine.recover``). Either way the runtime is built by name from
``runtimes.registry`` with the same arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..executor import Executor, ExecutorConfig
from ..models import DEFAULT_MODEL, resolve_model
from ..rings import Rings
from ..runtimes.registry import build_runtime
from ..runtimes.toy_vocab import ToyTokenizer
from ..worker.client import WorkerClient, WorkerConfig
from .config import EngineConfig
from .engine import Engine


def resolve_runtime(config: EngineConfig) -> EngineConfig:
    """The config with ``runtime="auto"`` replaced by the runtime that runs its model, the
    reason in ``runtime_reason`` (runtimes/auto.py); any other config as it is."""
    if config.runtime != "auto":
        return config
    from ..runtimes.auto import pick_runtime

    kind, why = pick_runtime(config.model or DEFAULT_MODEL)
    return dataclasses.replace(config, runtime=kind, runtime_reason=f"auto: {why}")


def runtime_args(config: EngineConfig) -> tuple[str, dict[str, Any], str]:
    """(registry kind, keyword arguments, model name) for the config's runtime."""
    config = resolve_runtime(config)
    kw: dict[str, Any] = {}
    if config.runtime == "toy":
        if config.quant not in ("auto", "none"):
            raise ValueError("quant applies to the torch runtime")
        if config.max_batch:
            kw["max_batch"] = config.max_batch
        if config.kv_cache_mb:
            kw["n_cells"] = max(64, config.kv_cache_mb * (1 << 20) // 64)  # the toy's cell is 64 bytes
        kw.update(config.runtime_extra)
        return "toy", kw, config.model or "toy"
    if config.runtime == "torch":
        name = config.model or DEFAULT_MODEL
        kw = dict(model=name, dtype=config.dtype, deterministic=config.deterministic, progress=config.progress)
        if config.kv_cache_mb:
            kw["kv_cache_mb"] = config.kv_cache_mb
        if config.max_batch:
            kw["max_batch"] = config.max_batch
        kw["quant"] = config.quant
        kw.update(config.runtime_extra)
        return "torch", kw, name
    if config.runtime == "llamacpp":
        return _llamacpp_args(config)
    raise ValueError(f"unknown runtime {config.runtime!r} (choose from auto, toy, torch, llamacpp)")


def _llamacpp_args(config: EngineConfig) -> tuple[str, dict[str, Any], str]:
    if config.quant not in ("auto",) or config.dtype not in (None, "auto"):
        raise ValueError("--quant and --dtype apply to the torch runtime (llama.cpp runs the file's own types)")
    if config.deterministic:
        raise ValueError("--deterministic needs the torch runtime (llama.cpp's rows depend on the batch)")
    name = config.model or DEFAULT_MODEL
    kw: dict[str, Any] = dict(model=name)
    if config.kv_cache_mb:
        kw["kv_cache_mb"] = config.kv_cache_mb
    if config.max_batch:
        kw["max_batch"] = config.max_batch
    kw.update(config.runtime_extra)
    return "llamacpp", kw, name


def _tokenizer_for(kind: str, kw: dict[str, Any], vocab_size: int):
    """The tokenizer without the weights (the worker holds those). Imported here, not
    above: the Hugging Face tokenizers library is slow to import and the toy needs none."""
    if kind == "toy":
        return ToyTokenizer(vocab_size)
    from ..tokenizer import Tokenizer

    path = resolve_model(kw["model"])
    if kind == "llamacpp":  # ours, or llama.cpp's own for a vocabulary ours does not know (an optional extra)
        from ..runtimes.llamacpp.tokenizer import gguf_tokenizer

        return gguf_tokenizer(path)
    return Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_hf(path)


def build_engine(config: EngineConfig) -> Engine:
    config = resolve_runtime(config)
    kind, kw, name = runtime_args(config)
    if config.worker:
        client = WorkerClient(WorkerConfig(runtime=kind, runtime_args=tuple(kw.items()), stall_timeout=config.worker_stall_timeout,
                                           host_cache_bytes=config.host_cache_mb << 20))
        try:
            client.start()
        except BaseException:
            client.close()  # the rings and the pulse are shared memory: give them back
            raise
        tokenizer = _tokenizer_for(kind, kw, client.desc.vocab_size)
        return Engine(client, client.rings, tokenizer, config, model_name=name, supervisor=client)

    runtime = build_runtime(kind, **kw)
    rings = Rings(runtime.desc.vocab_size)
    ex = Executor(runtime, rings, ExecutorConfig(host_cache_bytes=config.host_cache_mb << 20))
    return Engine(ex, rings, runtime.tokenizer, config, model_name=name)
