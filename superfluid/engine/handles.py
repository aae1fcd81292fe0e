"""The executor handles a request holds, owned from acquisition to release by one object.

A request may hold four: a logit bias, token rules, a compiled grammar, and an adopted lease (a
handed-over lane's KV, adopted into the executor for it; an admission consumes it).
``RequestHandles.acquire`` takes them when the request is submitted and ``release``
gives them back when it ends (``Request.finish`` calls it, whatever ended it: a finish,
an abort, an error, a handover).

Invariants:
- every handle acquired is released exactly once: ``release`` forgets what it gave back,
  so a second call does nothing;
- never when a lane retires: a preempted request comes back with its handles. The
  executor copied the bias into the lane and borrowed the grammar with a lane handle of
  its own, so the request's handles may go while its lane still lives;
- a lost worker takes every handle with it: ``renew`` forgets them unreleased and
  acquires new ones from the clean executor that took its place.
"""

from __future__ import annotations

from ..abi import Lease
from .params import ParamError, SamplingParams
from .token_rules import RulesSpec


class RequestHandles:
    """One request's handles (0 / None: not held). An empty one holds nothing and has no
    executor: the state of a request made outside an engine, e.g. in a test."""

    def __init__(self, executor=None, params: SamplingParams | None = None, adopted: Lease | None = None,
                 wait: bool = True, rules: RulesSpec | None = None):
        self._ex = executor
        self._params = params
        self._rules_spec = rules
        self._logit_bias = 0
        self._rules = 0
        self._grammar = 0
        self._adopted = adopted
        self._wait = wait  # compile the grammar before acquire returns; else in the background
        self.grammar_pending = False  # the grammar compiles: the request may not be admitted yet

    @classmethod
    def acquire(cls, executor, params: SamplingParams, adopted: Lease | None = None,
                wait: bool = True, rules: RulesSpec | None = None) -> RequestHandles:
        """Take the handles ``params`` asks for (and own ``adopted``). All or none: on a
        failure (ParamError for a grammar that does not compile) what was taken goes back.
        ``wait`` false: the grammar compiles in the executor's pool and the request waits
        (``grammar_pending``) until ``grammar_settled`` says how it ended."""
        handles = cls(executor, params, adopted, wait, rules)
        try:
            handles._take()
        except BaseException:
            handles.release()
            raise
        return handles

    @property
    def logit_bias(self) -> int:
        return self._logit_bias

    @property
    def token_rules(self) -> int:
        return self._rules

    @property
    def grammar(self) -> int:
        return self._grammar

    @property
    def adopted(self) -> Lease | None:
        return self._adopted

    def adopted_taken(self) -> None:
        """An accepted admit consumed the adopted lease: it is the executor's now."""
        self._adopted = None

    def renew(self) -> None:
        """The executor restarted clean (its worker was lost): the old handles died with
        it, unreleased; take the same ones anew. An adopted sequence is gone as well."""
        self._logit_bias = self._rules = self._grammar = 0
        self._adopted = None
        self.grammar_pending = False
        if self._ex is not None:
            self._take()

    def grammar_settled(self, state: int, message: str) -> None:
        """The background compile ended: ParamError (naming the request's field) if it failed."""
        self.grammar_pending = False
        if state != 1:
            g = self._params.grammar
            raise ParamError(f"invalid {g.kind.replace('_', ' ')}: {message}", g.param)

    def release(self) -> None:
        """Give every handle back, once."""
        bias, rules, grammar, adopted = self._logit_bias, self._rules, self._grammar, self._adopted
        self._logit_bias = self._rules = self._grammar = 0
        self._adopted = None
        try:
            if adopted is not None:
                self._ex.release_lease(adopted.handle)
            if bias:
                self._ex.release_logit_bias(bias)
            if rules:
                self._ex.release_token_rules(rules)
            if grammar:
                self._ex.release_grammar(grammar)
        except Exception:  # a lost worker took its handles with it; the next step recovers
            pass

    def _take(self) -> None:
        p = self._params
        if p.logit_bias:
            self._logit_bias = self._ex.register_logit_bias({int(k): float(v) for k, v in p.logit_bias.items()})
        r = self._rules_spec
        if r is not None:
            try:
                self._rules = self._ex.register_token_rules(r.allowed, r.bad_words, r.min_tokens, r.min_ban)
            except ValueError as e:
                raise ParamError(str(e), "allowed_token_ids" if r.allowed is not None else "bad_words") from e
        if p.grammar is not None:
            # One handle per choice: a plan may name a grammar handle once.
            try:
                if self._wait:
                    self._grammar = self._ex.compile_grammar(p.grammar.kind, p.grammar.source)
                else:
                    self._grammar = self._ex.compile_grammar(p.grammar.kind, p.grammar.source, wait=False)
                    self.grammar_pending = True
            except ValueError as e:  # GrammarError is a ValueError
                raise ParamError(f"invalid {p.grammar.kind.replace('_', ' ')}: {e}", p.grammar.param) from e
