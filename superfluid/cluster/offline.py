"""``LLM(replicas=N)``: ``generate`` spread over N replicas on Ray, one progress bar.

Each prompt is routed like a server request (shared prefixes to the replica that holds
them, else the least loaded) and streamed back through the front door's streams, so a
replica lost mid-job costs no prompt: its requests continue elsewhere."""

from __future__ import annotations

import asyncio
import itertools

from ..engine.config import EngineConfig
from ..engine.outputs import CompletionOutput, RequestOutput
from ..engine.params import SamplingParams
from .launch import ClusterConfig, start_cluster


class ClusterRunner:
    def __init__(self, config: EngineConfig, cfg: ClusterConfig):
        self.cluster = start_cluster(config, cfg, max_queued=1 << 30)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.cluster.tokenizer

    def run(self, texts: list[str | None], ids: list[list[int]], params: list[SamplingParams],
            progress: bool = True) -> list[RequestOutput]:
        for toks, p in zip(ids, params):  # every prompt is checked before any runs
            self.cluster.validate(toks, p)
        return asyncio.run(self._run(texts, ids, params, progress))

    async def _run(self, texts, ids, params, progress: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        self.cluster.start()
        bar = tqdm(total=len(ids), desc=f"generate on {len(self.cluster.slots)} replicas", disable=not progress)

        async def one(text, toks, p) -> RequestOutput:
            rid = f"llm-{next(self._ids)}"
            out = RequestOutput(rid, text, list(toks), [CompletionOutput(index=i) for i in range(p.n)])
            async for d in await self.cluster.submit(rid, toks, p):
                c = out.outputs[d.index]
                c.text += d.text
                c.token_ids += d.token_ids
                if d.logprobs:
                    c.logprobs = (c.logprobs or []) + d.logprobs
                if d.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs = d.prompt_logprobs
                if d.finish_reason is not None:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                    out.num_cached_tokens = max(out.num_cached_tokens, d.cached_tokens)
            out.finished = True
            for c in out.outputs:
                if c.logprobs is not None:
                    c.cumulative_logprob = sum(next(iter(e.values())).logprob for e in c.logprobs if e)
            bar.update(1)
            return out

        try:
            return list(await asyncio.gather(*(one(t, i, p) for t, i, p in zip(texts, ids, params))))
        finally:
            bar.close()

    def close(self) -> None:
        self.cluster.stop()
