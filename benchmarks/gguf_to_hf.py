#!/usr/bin/env python
"""Convert a GGUF file to a Hugging Face folder (fp32 safetensors, tokenizer, config) with
transformers, for peers that serve only Hugging Face folders (vLLM's CPU build).

    .venv/bin/python benchmarks/gguf_to_hf.py [--model PATH.gguf] --out build/hf-smollm2

transformers dequantizes the GGUF on load and records a GGUF quantizer marker in the
config; it is cleared before saving, so the folder reads as a plain fp32 checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from superfluid.models import DEFAULT_MODEL, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for obj in (model.config, getattr(model, "generation_config", None)):
        if obj is not None and hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    out = Path(args.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print("wrote", out)


if __name__ == "__main__":
    main()
