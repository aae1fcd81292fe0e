"""The synchronous engine: requests in, deltas out, one tick per ``step``.

It owns the tokenizer side of things (validation against the vocabulary and the
context, handles for logit bias and grammars, detokenization, stop-string text) and
drives the scheduler. Tokens reach it by one door: the scheduler's Finisher hands each
to ``_text``; ends reach it when they settle, between steps (``_settle``). It has one
output, ``output``: every delta goes there as it happens (by default an ``Outbox``
that keeps them until taken). Every method runs on one thread — the caller's for ``LLM``,
the background loop's for ``AsyncEngine`` — because the executor is not
thread-safe.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..executor.interface import ExecutorInterface, ExecutorLost, InProcess, Supervised
from ..executor.speculate import SpecConfig
from . import cache_keys, token_rules
from .choice import ChoiceState
from .config import EngineConfig
from .lifecycle import LIVE
from .outputs import Delta, ErrorCode, Outbox
from .params import ParamError, SamplingParams
from .handles import RequestHandles
from .priority import PriorityPolicy
from .request import ChoiceStart, FinishReason, Request, rng_base
from .scheduler import Scheduler

log = logging.getLogger("superfluid.engine")


class Engine:
    """``executor`` runs the ticks, in this process or another; ``supervisor`` keeps
    it alive (a worker's, or ``InProcess``: nothing to watch)."""

    def __init__(self, executor: ExecutorInterface, rings, tokenizer, config: EngineConfig = EngineConfig(),
                 model_name: str = "", supervisor: Supervised | None = None):
        self.ex = executor
        self.supervisor: Supervised = supervisor if supervisor is not None else InProcess()
        self.rings = rings
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name or config.model or executor.desc.runtime_id
        self.desc = executor.desc
        self._eos = frozenset(getattr(tokenizer, "eos_ids", ()) or ())
        self.scheduler = Scheduler(executor, rings, config.scheduler, eos_ids=self._eos)
        self.scheduler.finisher.text = self._text
        self._load_strategy()
        self._groups: dict[str, list[Request]] = {}
        self._choices: dict[int, ChoiceState] = {}  # id(request) -> its text state
        self._compiling: set[str] = set()  # request ids with a grammar compiling in the background
        self.output: Callable[[Delta], None] = Outbox()  # every delta, as it happens

    def stream_to(self, sink: Callable[[Delta], None] | None) -> None:
        """Make ``sink`` the output, with tokens going out while their tick runs (partial
        emits); None: back to an ``Outbox`` and deltas after each tick."""
        self.output = sink if sink is not None else Outbox()
        self.scheduler.streams = sink is not None

    # ------------------------------------------------------------ facts
    @property
    def vocab_size(self) -> int:
        return self.desc.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.desc.max_seq_len

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Everything that can be checked without the executor; raises ParamError."""
        if not prompt_token_ids:
            raise ParamError("the prompt is empty", "prompt")
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ParamError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
        if len(prompt_token_ids) >= self.max_seq_len:
            raise ParamError(
                f"This model's maximum context length is {self.max_seq_len} tokens. However, your request has "
                f"{len(prompt_token_ids)} input tokens (at least one must be left to generate). "
                "Please reduce the length of the input.",
                "prompt",
            )
        params.validate(self.vocab_size, self.config.max_n)
        if params.priority != 0 and not PriorityPolicy(self.config.scheduler.scheduling_policy).preempts:
            raise ParamError(
                f"priority {params.priority} was given, but priority scheduling is not enabled "
                "(the scheduling policy is fcfs)",
                "priority",
            )
        room = self.max_seq_len - len(prompt_token_ids)
        total = params.n * (room if params.max_tokens is None else min(params.max_tokens, room))
        if total > self.config.max_request_tokens:
            raise ParamError(f"n * max_tokens is {total} tokens; at most {self.config.max_request_tokens} per request",
                             "max_tokens")

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        choices: list[ChoiceStart] | None = None, wait_grammar: bool = True,
    ) -> list[Request]:
        """Validate, take handles, queue one request per choice. Raises ParamError.
        ``choices`` (default: all n, fresh) names the choices to run and where each
        starts: a request moved here from another replica resumes its unfinished ones.
        ``wait_grammar`` false: a grammar compiles in the background and the request
        waits for it unadmitted; ``poll_grammars`` tells when it is settled."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is in use")
        self.validate(prompt_token_ids, params)
        room = self.max_seq_len - len(prompt_token_ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        if choices is None:
            choices = [ChoiceStart(i, rng_base(params.seed, i)) for i in range(params.n)]
        rules = token_rules.resolve(params, self.tokenizer, self._eos)  # bad words in ids, once
        key = cache_keys.key_hash(params.prompt_cache_key, params.prompt_cache_retention)
        retention = cache_keys.retention_class(params.prompt_cache_key, params.prompt_cache_retention)
        reqs: list[Request] = []
        try:
            for c in choices:
                # One set per choice: a plan may name a grammar handle once.
                handles = RequestHandles.acquire(self.ex, params, c.lease, wait=wait_grammar, rules=rules)
                reqs.append(Request(
                    request_id=f"{request_id}-{c.index}",
                    prompt_token_ids=list(map(int, prompt_token_ids)),
                    params=params,
                    max_new_tokens=max_new, index=c.index, group_id=request_id, rng_base=c.rng_base,
                    output_token_ids=list(c.token_ids),
                    cache_key=key, cache_retention=retention, handles=handles,
                ))
        except BaseException:
            for req in reqs:
                req.handles.release()
            raise
        self._groups[request_id] = reqs
        try:
            for req in reqs:
                state = self._choices[id(req)] = ChoiceState(req, self.tokenizer, self._eos)
                # Tokens generated elsewhere: their text went out from there; this state only
                # catches up (detokenizer, held-back stop-string text) so the next token's
                # text continues it exactly.
                for token in req.output_token_ids:
                    state.process(token, None)
                self.scheduler.add(req, fresh=True)
        except BaseException:
            # All or nothing: a request that fails part-way leaves no choice queued.
            for req in reqs:
                self.scheduler.forget(req)
                self._choices.pop(id(req), None)
                req.handles.release()
            self._groups.pop(request_id, None)
            raise
        if self.grammar_pending(request_id):
            self._compiling.add(request_id)
        return reqs

    def grammar_pending(self, request_id: str) -> bool:
        return any(r.handles.grammar_pending for r in self._groups.get(request_id, []))

    def poll_grammars(self) -> list[tuple[str, ParamError | None]]:
        """Requests whose background grammar compiles ended: (request id, None) once every
        choice's is ready, (request id, ParamError) when one failed, the request then
        ended with that error. One executor call for all that are pending."""
        self._compiling &= self._groups.keys()  # those that ended meanwhile (aborted) are not waited for
        pending = [r for rid in self._compiling for r in self._groups[rid] if r.handles.grammar_pending]
        if not pending:
            self._compiling.clear()
            return []
        try:
            states = self.ex.grammar_states([r.handles.grammar for r in pending])
        except ExecutorLost as e:
            self.recover_or_fail(e)  # the new worker compiles them again
            return []
        failed: dict[str, ParamError] = {}
        for req, (state, message) in zip(pending, states):
            if state == 0:
                continue
            try:
                req.handles.grammar_settled(state, message)
            except ParamError as e:
                failed.setdefault(req.group_id, e)
        settled = []
        for rid in {r.group_id for r in pending}:
            if rid in failed:
                self.fail(rid, str(failed[rid]), ErrorCode.INVALID_GRAMMAR)
                settled.append((rid, failed[rid]))
            elif not self.grammar_pending(rid):
                settled.append((rid, None))
        self._compiling -= {rid for rid, _ in settled}
        return settled

    def _load_strategy(self) -> None:
        # Not on an exact_only runtime (recurrent state): a draft the model rejects must be cut
        # back, and such a state refuses a partial truncate.
        if self.config.scheduler.speculative and not self.desc.exact_only:
            self.scheduler.use_strategy(self.ex.load_strategy(SpecConfig()))

    def recover(self) -> None:
        """After the executor was lost: start a clean one and re-admit every live
        request (same tokens, same rng base, decode replay), with new handles."""
        self.supervisor.restart()
        self._load_strategy()
        for req in self.scheduler.lanes_lost():
            req.handles.renew()
            if req.handles.grammar_pending:  # compiled again, in the background, by the new worker
                self._compiling.add(req.group_id)

    def check_worker(self) -> None:
        """Replace a worker that died while nothing ran (a tick would notice otherwise);
        the loop calls this when idle, so that /health is ok again without a request."""
        try:
            self.supervisor.check()
        except ExecutorLost as e:
            self.recover_or_fail(e)

    def close(self) -> None:
        """Stop the model's worker process, if one runs it."""
        self.scheduler.host.close()
        self.supervisor.close()

    @property
    def model_pid(self) -> int | None:
        """The process that runs the model: the worker's (None while none runs, e.g.
        between a lost worker and its replacement), or this one."""
        return self.supervisor.pid

    def worker_health(self) -> dict | None:
        """The supervised worker's state (None when the model runs in this process):
        ``state`` is ok, starting, restarting, failed or stopped; a worker that has
        exited but is not yet replaced counts as restarting. Safe from any thread."""
        return self.supervisor.health()

    def fail(self, request_id: str, message: str, code: ErrorCode) -> None:
        """End a request's unfinished choices with an error (e.g. the server stops)."""
        for req in self._groups.get(request_id, []):
            self.scheduler.end(req, FinishReason.ERROR, message, code)
        self._settle()

    def is_running(self, request_id: str) -> bool:
        """Whether some choice of the request holds a lane (is not waiting for one)."""
        return any(r.phase in LIVE for r in self._groups.get(request_id, []))

    def detach(self, request_id: str) -> list[Request]:
        """Let a request go without finishing it, because it continues elsewhere (a
        draining replica hands it over): no delta is emitted, its handles are released,
        and a running choice's lane retires at the next tick, publishing its KV to the
        cache (so that ``export_prefix`` can hand that over). Returns its unfinished
        choices, as they stand."""
        live = [r for r in self._groups.pop(request_id, []) if not r.is_finished]
        for req in live:
            self._choices.pop(id(req), None)
            self.scheduler.detach(req)
        self._settle()
        return live

    def abort(self, request_id: str) -> None:
        for req in self._groups.get(request_id, []):
            self.scheduler.end(req, FinishReason.ABORT)
        self._settle()

    # ------------------------------------------------------------ stepping
    def step(self) -> None:
        """One tick; its deltas go to ``output`` as they happen. Whatever ended in it
        settles after it, even when it raised, before a lost worker is replaced."""
        lost = failed = None
        try:
            self.scheduler.step()
        except ExecutorLost as e:
            lost = e
        except Exception as e:
            failed = e
        self._settle()
        if lost is not None:
            self.recover_or_fail(lost)
        elif failed is not None:
            self._isolate(failed)

    def _isolate(self, error: Exception) -> None:
        """A step raised: fail the request it is blamed on, not every request. When no
        new request can be blamed, a supervised worker is replaced and its requests
        replayed (the same text); only an executor in this process fails everything."""
        blamed = self.scheduler.isolate(error)
        if blamed is not None:
            log.warning("a step failed (%r); blamed: %s", error, [r.request_id for r in blamed] or "one of several (probation)")
            self._settle()
            return
        if not isinstance(self.supervisor, InProcess):
            log.error("a step failed with no new request to blame (%r): replacing the worker", error)
            self.recover_or_fail(ExecutorLost(f"engine error: {error!r}"))
            return
        self._fail_all(f"engine error: {error}", ErrorCode.ENGINE_ERROR)
        raise error

    def _text(self, req: Request, token: int, lp) -> bool:
        """A token the Finisher took for ``req``: its text goes out; True when a stop
        string ended the request at it."""
        state = self._choices.get(id(req))
        if state is None:
            return False
        if state.n_processed == 0 and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        delta = state.process(token, lp)
        if delta is not None:
            self.output(delta)
        return state.stop.stopped is not None

    def _settle(self) -> None:
        """Requests whose end settled: their last delta goes out."""
        for req in self.scheduler.settle():
            self._finalize(req)

    def _finalize(self, req: Request) -> None:
        state = self._choices.get(id(req))
        if state is None or state.done:
            return
        self.output(state.finalize())
        del self._choices[id(req)]
        group = self._groups.get(req.group_id, [])
        if all(r.is_finished for r in group):
            self._groups.pop(req.group_id, None)

    def recover_or_fail(self, lost: ExecutorLost) -> None:
        """The executor was lost: replace it and replay every live request (``recover``),
        again while replacements are lost; when none can start, every request fails."""
        log.warning("the model worker was lost (%s); starting a clean one and replaying its requests", lost)
        while True:
            try:
                self.recover()
                return
            except ExecutorLost as e:  # the new worker was lost too, while taking over: again
                # (the supervisor bounds restarts: WorkerFailed when they run out)
                log.warning("the model worker was lost again while taking over (%s); starting another", e)
                continue
            except Exception as e:
                # restarts ran out, or the model no longer loads
                log.error("the model worker cannot be restarted: %s", e)
                self._fail_all(f"the model worker failed: {e}", ErrorCode.WORKER_FAILED)
                return

    def _fail_all(self, message: str, code: ErrorCode) -> None:
        for reqs in list(self._groups.values()):
            for req in reqs:
                self.scheduler.end(req, FinishReason.ERROR, message, code)
        self._settle()

