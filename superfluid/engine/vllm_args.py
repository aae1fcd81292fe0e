"""vLLM's ``LLM(...)`` arguments, mapped onto an ``EngineConfig`` where they mean something here.

- ``max_model_len``: the runtime's ``max_seq_len`` (the context, prompt plus output).
- ``max_num_seqs``: the scheduler's ``max_running`` (lanes at once).
- ``dtype``: "auto" is the runtime's choice; "half" / "float" are float16 / float32.
- ``quantization``: "gguf" (or None) runs the file's own types; ``quant``'s names pass.
- ``tokenizer``: only the model's own (a GGUF carries its tokenizer; the grammars'
  vocabulary is the runtime's, so another tokenizer would disagree with it).
- ``seed`` is the LLM's (entrypoints/llm.py): requests without one get seeds drawn from it in order.

vLLM arguments that only tune vLLM's own machinery (``trust_remote_code``,
``enforce_eager``, ...) are accepted and change nothing; a parallel size other than 1 is a
ValueError; any other argument is a TypeError naming it.
"""

from __future__ import annotations

import dataclasses
import logging

from ..models import DEFAULT_MODEL, resolve_model
from .config import EngineConfig

log = logging.getLogger("superfluid.engine")

NO_EFFECT = frozenset({"trust_remote_code", "enforce_eager", "disable_log_stats", "gpu_memory_utilization",
                       "swap_space", "disable_custom_all_reduce", "tokenizer_mode", "download_dir"})
MUST_BE_ONE = frozenset({"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"})
_DTYPES = {"auto": None, "half": "float16", "float": "float32"}
_QUANTS = ("auto", "none", "q8_0", "q4_1")


def check_extra(kwargs: dict) -> None:
    """vLLM arguments with no meaning here: accepted or refused, never silently unknown."""
    for name, value in kwargs.items():
        if name in MUST_BE_ONE:
            if value not in (None, 1):
                raise ValueError(f"{name}={value!r}: superfluid runs a model on one device (use replicas= to scale out)")
        elif name in NO_EFFECT:
            log.info("LLM(%s=...) is vLLM's and changes nothing here", name)
        else:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")


def dtype(value: str | None) -> str | None:
    return _DTYPES.get(value, value) if value is not None else None


def quant(quantization: str | None, given: str) -> str:
    if quantization is None or quantization == "gguf":
        return given
    if quantization in _QUANTS:
        return quantization
    raise ValueError(f"quantization={quantization!r} is not supported (gguf, or one of {', '.join(_QUANTS)})")


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return resolve_model(a) == resolve_model(b)
    except Exception:  # a name nothing resolves: not the model's
        return False


def apply(config: EngineConfig, *, max_model_len: int | None, max_num_seqs: int | None,
          tokenizer: str | None) -> EngineConfig:
    if tokenizer is not None and not _same_model(tokenizer, config.model or DEFAULT_MODEL):
        raise ValueError(f"tokenizer={tokenizer!r}: only the model's own tokenizer is supported")
    if max_model_len is not None:
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer of at least 2, got {max_model_len!r}")
        config = dataclasses.replace(config, runtime_extra=config.runtime_extra + (("max_seq_len", max_model_len),))
    if max_num_seqs is not None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_running=max_num_seqs))
    return config
