"""One choice's text: detokenization, stop strings and logprobs, token by token.

Invariants:
- Tokens are processed in order, once each (``n_processed`` counts them); the text
  released so far never contains a stop string nor a partial UTF-8 character.
- When a stop string matches, the request's token ids are cut after the token
  that completed it, and nothing after that token is processed.
"""

from __future__ import annotations

from .. import abi
from .detokenizer import Detokenizer
from .outputs import CompletionOutput, Delta, Logprob, TokenLogprobs
from .request import Request
from .stop import StopChecker


class ChoiceState:
    def __init__(self, req: Request, tokenizer, eos_ids: frozenset[int]):
        self.req = req
        self._tok = tokenizer
        self._eos = eos_ids
        p = req.params
        self.detok = Detokenizer(tokenizer, p.skip_special_tokens)
        self.stop = StopChecker(p.stop, p.include_stop_str_in_output)
        self.output = CompletionOutput(index=req.index, logprobs=[] if p.logprobs is not None else None)
        self.n_processed = 0
        self._prompt_sent = False
        self.done = False  # the final delta went out

    def process(self, token: int, lp: abi.LaneLogprob | None) -> Delta | None:
        """Take the request's next token; a delta if there is anything to tell."""
        if self.done or self.stop.stopped is not None:
            return None
        req = self.req
        self.n_processed += 1
        delta = Delta(req.group_id, req.index, token_ids=[token], prompt_logprobs=self._prompt_logprobs())
        self.output.token_ids.append(token)
        if self.output.logprobs is not None:
            entry = self._logprobs(token, lp)
            self.output.logprobs.append(entry)
            delta.logprobs.append(entry)
            if lp is not None:
                self.output.cumulative_logprob = (self.output.cumulative_logprob or 0.0) + lp.logprob
        if not self._ends_without_text(token):
            # vLLM: no stop string ends a generation shorter than min_tokens
            delta.text = self.stop.push(self.detok.push(token), armed=self.n_processed >= req.params.min_tokens)
        if self.stop.stopped is not None:
            # The stop string ends the request here: later tokens never happened.
            del req.output_token_ids[self.n_processed :]
            self.output.stop_reason = self.stop.stopped
        self.output.text += delta.text
        return delta

    def _ends_without_text(self, token: int) -> bool:
        """EOS and stop token ids end a generation; their text is not part of it."""
        p = self.req.params
        return token in p.stop_token_ids or (token in self._eos and not p.ignore_eos)

    def finalize(self) -> Delta:
        """The last delta: whatever was held back, the finish reason, usage."""
        req = self.req
        self.done = True
        tail = ""
        if self.stop.stopped is None:
            tail = self.stop.push(self.detok.flush())
            tail += self.stop.flush()
        self.output.text += tail
        reason = req.finish_reason.value if req.finish_reason else "stop"
        if reason == "stop" and self.output.stop_reason is None and req.output_token_ids:
            last = req.output_token_ids[-1]
            if last in req.params.stop_token_ids:
                self.output.stop_reason = last
        self.output.finish_reason = reason
        return Delta(
            req.group_id,
            req.index,
            prompt_logprobs=self._prompt_logprobs(),
            text=tail,
            finish_reason=reason,
            stop_reason=self.output.stop_reason,
            error=req.error,
            error_code=req.error_code,
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=len(req.output_token_ids),
            cached_tokens=req.cached_tokens,
        )

    def _prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """Once, on the choice's first delta: the prompt's scores (the first token has none)."""
        if self.req.params.prompt_logprobs is None or self._prompt_sent:
            return None
        self._prompt_sent = True
        prompt, scores = self.req.prompt_token_ids, self.req.prompt_scores
        out: list[TokenLogprobs | None] = [None]
        for pos in range(1, len(prompt)):
            s = scores.get(pos)
            out.append(self._logprobs(prompt[pos], s) if s is not None else {})
        self.output.prompt_logprobs = out
        return out

    def _logprobs(self, token: int, lp: abi.LaneLogprob | None) -> TokenLogprobs:
        if lp is None:
            return {}
        rank = None
        for i, t in enumerate(lp.top_ids):
            if t == token:
                rank = i + 1
                break
        entry: TokenLogprobs = {token: Logprob(float(lp.logprob), rank, self.piece(token))}
        for i, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
            if t not in entry:
                entry[t] = Logprob(float(v), i + 1, self.piece(t))
        return entry

    def piece(self, token: int) -> str:
        return self._tok.token_bytes(token).decode("utf-8", errors="replace")
