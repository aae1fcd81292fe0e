"""Offline throughput: ``LLM.generate`` against transformers' ``generate`` on the same weights.

Both get the same prompts as the same token ids (rendered with the model's chat
template, encoded once by superfluid's tokenizer), greedy decoding and a fixed number
of new tokens each (``ignore_eos`` / ``min_new_tokens``), in the same process, one
after the other, each after a short warm-up. Weight loading is not timed. transformers
loads the GGUF (dequantized to ``hf_dtype``) with
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` and runs left-padded batches
of ``hf_batch_size`` prompts.

The result also says how many prompts' greedy outputs agree token for token (a float32
model and a kernel that sums in a different order can part ways after a near-tie).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from .datasets import make_dataset

SCHEMA = "superfluid.bench.offline/1"
RESULT_KEYS = ("schema", "config", "started_at", "num_prompts", "prompt_tokens", "superfluid", "transformers",
               "ratio", "greedy_agreement")


@dataclass
class OfflineConfig:
    model: str = "SmolLM2-135M-Instruct"
    runtime: str = "auto"
    dtype: str | None = None  # superfluid's; None: the runtime's default
    hf_dtype: str = "float32"
    num_prompts: int = 16
    output_len: int = 64
    dataset: str = "chat"
    seed: int = 0
    hf_batch_size: int = 16
    threads: int = 0  # torch threads for both; 0: leave torch's default
    max_prompt_tokens: int = 0  # >0: keep each prompt's last this many tokens (small-context models)
    skip_hf: bool = False


def _prompt_ids(llm, cfg: OfflineConfig) -> list[list[int]]:
    tok = llm.tokenizer
    reqs = make_dataset(cfg.dataset, cfg.num_prompts, cfg.seed, cfg.output_len)
    texts = [tok.apply_chat_template([dict(m) for m in r.messages], add_generation_prompt=True) for r in reqs]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    return [p[-cfg.max_prompt_tokens:] for p in ids] if cfg.max_prompt_tokens else ids


def _bench_superfluid(llm, prompts: list[list[int]], output_len: int) -> tuple[dict, list[list[int]]]:
    from superfluid import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(x) for x in toks)
    return {"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt, "requests_per_s": len(prompts) / dt}, toks


def _bench_hf(model_path, prompts: list[list[int]], output_len: int, batch: int, dtype: str,
              pad_id: int) -> tuple[dict, list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=getattr(torch, dtype)).eval()

    def run(chunk: list[list[int]], new: int) -> list[list[int]]:
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # left padding: [B, S]
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad_id)
        return [row[width:].tolist() for row in out]

    run(prompts[:1], 4)  # warm-up
    t = time.perf_counter()
    toks: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        toks += run(prompts[i:i + batch], output_len)
    dt = time.perf_counter() - t
    n = sum(len(x) for x in toks)
    return {"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt, "requests_per_s": len(prompts) / dt}, toks


def run_offline(cfg: OfflineConfig) -> dict:
    import torch

    from superfluid import LLM
    from superfluid.models import resolve_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    llm = LLM(model=cfg.model, runtime=cfg.runtime, dtype=cfg.dtype)
    prompts = _prompt_ids(llm, cfg)
    sf, sf_toks = _bench_superfluid(llm, prompts, cfg.output_len)
    result = {
        "schema": SCHEMA,
        "config": asdict(cfg) | {"torch_threads": torch.get_num_threads(), "runtime_picked": llm.engine.config.runtime},
        "started_at": started,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "superfluid": sf,
        "transformers": None,
        "ratio": None,
        "greedy_agreement": None,
    }
    if cfg.skip_hf or llm.engine.config.runtime == "toy":
        return result  # the toy runtime has no weights for transformers to load
    pad_id = llm.tokenizer.eos_ids[0] if llm.tokenizer.eos_ids else 0  # masked out; any id will do
    del llm  # free the engine's memory before transformers loads its copy
    hf, hf_toks = _bench_hf(resolve_model(cfg.model), prompts, cfg.output_len, cfg.hf_batch_size, cfg.hf_dtype, pad_id)
    result["transformers"] = hf
    result["ratio"] = sf["output_tokens_per_s"] / hf["output_tokens_per_s"]
    result["greedy_agreement"] = sum(a == b for a, b in zip(sf_toks, hf_toks)) / len(prompts)
    return result


def format_offline(r: dict) -> str:
    sf, hf = r["superfluid"], r["transformers"]
    lines = [f"offline: {r['num_prompts']} prompts ({r['prompt_tokens']} prompt tokens), "
             f"{r['config']['output_len']} new tokens each, torch threads {r['config']['torch_threads']}",
             f"  superfluid    {sf['output_tokens_per_s']:8.1f} tok/s  ({sf['output_tokens']} tokens in {sf['seconds']:.2f}s)"]
    if hf:
        lines.append(f"  transformers  {hf['output_tokens_per_s']:8.1f} tok/s  ({hf['output_tokens']} tokens in {hf['seconds']:.2f}s)")
        lines.append(f"  ratio {r['ratio']:.2f}x, greedy outputs identical for {r['greedy_agreement']:.0%} of prompts")
    return "\n".join(lines)
