"""The offline Python API, at vLLM's level: ``LLM(model=...).generate(prompts, sampling_params)``.

Runs the engine on the caller's thread until every request of the call finished,
and returns vLLM-shaped ``RequestOutput``s in the order of the prompts. Prompts are
strings, token-id lists, or vLLM's dicts (``{"prompt": ...}``,
``{"prompt_token_ids": [...]}``); ``sampling_params`` is one ``SamplingParams`` or
one per prompt. ``LLM(..., worker=True)`` runs the model in the supervised worker
process, as the server does (a worker that dies is replaced and its requests
replayed); logits processors and samplers still run here, on the rows that cross
the shared-memory ring.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Callable, Sequence

from ..engine.config import EngineConfig, SchedulerConfig
from ..engine.engine import Engine
from ..engine.loader import build_engine
from ..engine import vllm_args
from ..engine.outputs import CompletionOutput, Delta, RequestOutput
from ..engine.params import SEED_MAX, SamplingParams
from ..engine.request import rng_base

PromptLike = str | list[int] | dict
TQDM_AUTO_MIN = 5  # use_tqdm=None: a progress bar from this many prompts on


class LLM:
    def __init__(
        self,
        model: str | None = None,
        runtime: str = "auto",
        *,
        dtype: str | None = None,
        quant: str = "auto",
        kv_cache_mb: int = 0,
        max_batch: int = 0,
        deterministic: bool = False,
        scheduler: SchedulerConfig = SchedulerConfig(),
        scheduling_policy: str | None = None,  # "priority" | "fcfs" (default: the scheduler config's)
        worker: bool = False,
        runtime_args: dict[str, Any] | None = None,  # more keyword arguments for the runtime
        progress: bool = False,
        engine: Engine | None = None,
        replicas: int = 0,
        # vLLM's names (vllm_args.py says how each maps)
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        seed: int | None = None,
        tokenizer: str | None = None,
        quantization: str | None = None,
        **vllm_engine_args: Any,
    ):
        """``replicas=N``: N engines on Ray (a local instance unless one is running),
        ``generate`` spread over them (superfluid.cluster; needs the ray extra).
        ``seed``: requests without a seed get one drawn from it, so a script's outputs
        repeat from run to run (vLLM's meaning)."""
        vllm_args.check_extra(vllm_engine_args)
        if scheduling_policy is not None:
            scheduler = dataclasses.replace(scheduler, scheduling_policy=scheduling_policy)
        config = EngineConfig(
            model=model or "", runtime=runtime, dtype=vllm_args.dtype(dtype), quant=vllm_args.quant(quantization, quant),
            kv_cache_mb=kv_cache_mb, max_batch=max_batch, deterministic=deterministic, progress=progress,
            worker=worker, runtime_extra=tuple((runtime_args or {}).items()), scheduler=scheduler,
        )
        config = vllm_args.apply(config, max_model_len=max_model_len, max_num_seqs=max_num_seqs, tokenizer=tokenizer)
        self._seeds = None if seed is None else itertools.count(0)
        self._seed = seed
        self._cluster = None
        owned = engine is None and not replicas
        if replicas:
            from ..cluster.launch import ClusterConfig
            from ..cluster.offline import ClusterRunner

            self._cluster = ClusterRunner(config, ClusterConfig(replicas=replicas, replica_cpus=0.5))
            self.engine = None
        else:
            self.engine = build_engine(config) if owned else engine
        self._ids = itertools.count()
        # An engine this object built (and its worker process, if any) goes with it, or at
        # interpreter exit; one handed in stays its owner's.
        closer = self._cluster.close if self._cluster is not None else self.engine.close if owned else None
        self._finalizer = weakref.finalize(self, closer or (lambda: None))

    @property
    def tokenizer(self):
        return self._cluster.tokenizer if self._cluster is not None else self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        """Stop the model's worker process, if one runs it."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ generation
    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: list[int] | Sequence[list[int]] | None = None,
        use_tqdm: bool | Callable | None = None,
        priority: Sequence[int] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,  # the earlier name
    ) -> list[RequestOutput]:
        if prompts is None:
            if prompt_token_ids is None:
                raise ValueError("give prompts or prompt_token_ids")
            prompts = [list(prompt_token_ids)] if _is_ids(prompt_token_ids) else [list(p) for p in prompt_token_ids]
        elif prompt_token_ids is not None:
            raise ValueError("give prompts or prompt_token_ids, not both")
        if isinstance(prompts, (str, dict)) or _is_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        texts, ids = [], []
        for p in prompts:
            text, toks = self._prompt(p)
            texts.append(text)
            ids.append(toks)
        return self._run(texts, ids, sampling_params if sampling_params is not None else params, use_tqdm, priority)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable | None = None,
        add_generation_prompt: bool | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,  # the earlier name
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a batch of them, as vLLM's
        ``LLM.chat``: ``tools`` and ``chat_template_kwargs`` are the template's variables,
        ``chat_template`` replaces the model's, ``continue_final_message`` continues the
        last (assistant) message. ``add_generation_prompt`` defaults to true unless the
        final message is continued."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        kw = dict(chat_template_kwargs or {})
        if tools is not None:
            kw["tools"] = tools
        if continue_final_message:  # only when asked: a tokenizer without the argument serves the rest
            kw["continue_final_message"] = True
        if chat_template is not None:
            kw["chat_template"] = chat_template
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, **kw) for c in convs]
        ids = [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        return self._run(texts, ids, sampling_params if sampling_params is not None else params, use_tqdm, None)

    def _prompt(self, p: PromptLike) -> tuple[str | None, list[int]]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]
            if "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError("a prompt dict has 'prompt' or 'prompt_token_ids'")
        if isinstance(p, str):  # the file's BOS where its tokenizer asks for one, as vLLM
            return p, self.tokenizer.encode(p, add_special_tokens=True)
        return None, [int(t) for t in p]

    def _run(self, texts, ids, params, use_tqdm, priority) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError(f"one SamplingParams, or one per prompt ({len(ids)}); got {len(plist)}")
        if priority is not None:
            if len(priority) != len(ids):
                raise ValueError(f"one priority per prompt ({len(ids)}); got {len(priority)}")
            plist = [p.with_(priority=int(pr)) for p, pr in zip(plist, priority)]
        plist = self._seeded(plist)
        if self._cluster is not None:
            return self._cluster.run(texts, ids, plist, progress=_progress_wanted(use_tqdm, len(ids)))
        outputs: dict[str, RequestOutput] = {}
        order = []
        try:
            for text, toks, p in zip(texts, ids, plist):
                rid = f"llm-{next(self._ids)}"
                reqs = self.engine.add_request(rid, toks, p)
                outputs[rid] = RequestOutput(rid, text, list(toks), [CompletionOutput(index=i) for i in range(len(reqs))])
                order.append(rid)
        except BaseException:
            for rid in order:  # a bad prompt refuses the call: none of it stays queued
                self.engine.abort(rid)
            self._settle()
            raise
        bar = _progress(use_tqdm, len(order))
        pending = set(outputs)
        try:
            while pending:
                self.engine.step()
                for d in self.engine.output.take():
                    if _apply(outputs.get(d.request_id), d):
                        pending.discard(d.request_id)
                        if bar is not None:
                            bar.update(1)
                if pending and not self.engine.has_work():
                    raise RuntimeError("the engine stopped with requests unfinished")
        finally:
            if bar is not None:
                bar.close()
        self._settle()
        for out in outputs.values():
            for c in out.outputs:
                if c.logprobs is not None:
                    c.cumulative_logprob = sum(next(iter(e.values())).logprob for e in c.logprobs if e)
        return [outputs[r] for r in order]

    def _seeded(self, plist: list[SamplingParams]) -> list[SamplingParams]:
        """LLM(seed=...): each unseeded request, in order, gets the next seed drawn from it."""
        if self._seeds is None:
            return plist
        return [p if p.seed is not None else p.with_(seed=rng_base(self._seed, next(self._seeds)) & SEED_MAX)
                for p in plist]

    def _settle(self) -> None:
        while self.engine.has_work():  # retire (and publish) the finished lanes
            self.engine.step()
        self.engine.output.take()  # what ended with them was told, or not asked for


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], int)


def _apply(out: RequestOutput | None, d: Delta) -> bool:
    """Fold a delta into its output; True when that finished the whole request."""
    if out is None:
        return False
    c = out.outputs[d.index]
    c.text += d.text
    c.token_ids += d.token_ids
    if d.logprobs:
        c.logprobs = (c.logprobs or []) + d.logprobs
    if d.prompt_logprobs is not None:
        c.prompt_logprobs = out.prompt_logprobs = d.prompt_logprobs
    if d.finish_reason is None:
        return False
    c.finish_reason, c.stop_reason, c.error, c.error_code = d.finish_reason, d.stop_reason, d.error, d.error_code
    out.num_cached_tokens = max(out.num_cached_tokens, d.cached_tokens)
    if all(o.finish_reason for o in out.outputs):
        out.finished = True
        return True
    return False


def _progress_wanted(use_tqdm: bool | Callable | None, total: int) -> bool:
    return bool(total >= TQDM_AUTO_MIN if use_tqdm is None else use_tqdm)


def _progress(use_tqdm: bool | Callable | None, total: int):
    if use_tqdm is None:
        use_tqdm = total >= TQDM_AUTO_MIN
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", unit="prompt")
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
