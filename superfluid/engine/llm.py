"""The offline Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Runs the engine on the caller's thread until every request of the call finished,
and returns vLLM-shaped ``RequestOutput``s in the order of the prompts.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from .config import EngineConfig, SchedulerConfig
from .engine import Engine
from .loader import build_engine
from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams

PromptLike = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        runtime: str = "torch",
        *,
        dtype: str | None = None,
        quant: str = "auto",
        kv_cache_mb: int = 0,
        max_batch: int = 0,
        deterministic: bool = False,
        scheduler: SchedulerConfig = SchedulerConfig(),
        progress: bool = False,
        engine: Engine | None = None,
        replicas: int = 0,
    ):
        """``replicas=N``: N engines on Ray (a local instance unless one is running),
        ``generate`` spread over them (superfluid.cluster; needs the ray extra)."""
        config = EngineConfig(
            model=model or "",
            runtime=runtime,
            dtype=dtype,
            quant=quant,
            kv_cache_mb=kv_cache_mb,
            max_batch=max_batch,
            deterministic=deterministic,
            progress=progress,
            scheduler=scheduler,
        )
        self._cluster = None
        if replicas:
            from ..cluster.launch import ClusterConfig
            from ..cluster.offline import ClusterRunner

            self._cluster = ClusterRunner(config, ClusterConfig(replicas=replicas, replica_cpus=0.5))
            self.engine = None
        else:
            self.engine = engine if engine is not None else build_engine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self._cluster.tokenizer if self._cluster is not None else self.engine.tokenizer

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (one, or a list of them)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        texts, ids = [], []
        for p in prompts:
            if isinstance(p, str):
                texts.append(p)
                ids.append(self.tokenizer.encode(p, add_special_tokens=False))
            else:
                texts.append(None)
                ids.append(list(p))
        return self._run(texts, ids, params)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self._run(texts, ids, params)

    def _run(self, texts, ids, params) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError("one SamplingParams, or one per prompt")
        if self._cluster is not None:
            return self._cluster.run(texts, ids, plist)
        outputs: dict[str, RequestOutput] = {}
        order = []
        for text, toks, p in zip(texts, ids, plist):
            rid = f"llm-{next(self._ids)}"
            reqs = self.engine.add_request(rid, toks, p)
            outputs[rid] = RequestOutput(rid, text, list(toks), [CompletionOutput(index=i) for i in range(len(reqs))])
            order.append(rid)
        pending = set(outputs)
        while pending:
            for d in self.engine.step():
                out = outputs.get(d.request_id)
                if out is None:
                    continue
                c = out.outputs[d.index]
                c.text += d.text
                c.token_ids += d.token_ids
                if d.logprobs:
                    c.logprobs = (c.logprobs or []) + d.logprobs
                if d.finish_reason is not None:
                    c.finish_reason = d.finish_reason
                    c.stop_reason = d.stop_reason
                    out.num_cached_tokens = max(out.num_cached_tokens, d.cached_tokens)
                    if all(o.finish_reason for o in out.outputs):
                        out.finished = True
                        pending.discard(d.request_id)
            if pending and not self.engine.has_work():
                raise RuntimeError("the engine stopped with requests unfinished")
        while self.engine.has_work():  # retire (and publish) the finished lanes
            self.engine.step()
        for out in outputs.values():
            for c in out.outputs:
                if c.logprobs is not None:
                    c.cumulative_logprob = sum(next(iter(e.values())).logprob for e in c.logprobs if e)
        return [outputs[r] for r in order]

