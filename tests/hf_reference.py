"""transformers' own load of the default GGUF, the numerics oracle several test modules
compare against, made once per test session (a load dequantizes every tensor to fp32:
10-20 s on 2 cores, which each module used to pay again)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def default_tokenizer():
    from transformers import AutoTokenizer

    from superfluid.models import DEFAULT_MODEL, resolve_model

    p = resolve_model(DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@functools.lru_cache(maxsize=None)
def default_model():
    """fp32, in eval mode; callers only read it."""
    import torch
    from transformers import AutoModelForCausalLM

    from superfluid.models import DEFAULT_MODEL, resolve_model

    p = resolve_model(DEFAULT_MODEL)
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
