"""What a user asks of one generation: the vLLM-shaped ``SamplingParams``.

This is the engine's side of sampling. It is validated once (``validate``) and
then turned into the executor's ``abi.LaneParams`` plus handles (logit bias,
grammar) when the request is admitted. Ranges follow OpenAI's API where it has
one (temperature in [0, 2], penalties in [-2, 2], logit bias in [-100, 100],
top_logprobs up to 20).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from .. import abi
from ..abi import MAX_TOP_LOGPROBS
from .cache_keys import check as check_cache_key
from .errors import ParamError


MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string (each is searched for in every delta)
MAX_STOP_TOKEN_IDS = 64
# Numeric bounds (every number is bounded where it enters: the server's request models
# declare the same bounds, so a value past one is a 400 naming its field before any
# engine work, and the tick's wire types can always carry what was accepted).
INT32_MAX = (1 << 31) - 1
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), INT32_MAX
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # vLLM's range; rng_base folds it to 64 bits
MAX_TOP_K = INT32_MAX  # past the vocabulary it means "off" (every sampler treats k >= V so)
MAX_TOKENS_CAP = INT32_MAX
MAX_LOGIT_BIAS = 1024  # entries
MAX_N_CAP = 1024  # the largest --max-n a server may set
MAX_BAD_WORDS = 64  # words per request (each becomes up to two token sequences)
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 17

@dataclass(frozen=True)
class GrammarSpec:
    """A constrained-decoding request: kind is one the executor compiles
    ("json_object", "json_schema", "regex", "ebnf"); source is its text."""

    kind: str
    source: str = ""
    param: str = "response_format"  # the request field it came from (errors name it)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: chosen token plus the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob plus the top k
    prompt_cache_key: str | None = None  # requests sharing it share protected cache entries (cache_keys.py)
    prompt_cache_retention: str | None = None  # "in_memory" | "24h"
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: GrammarSpec | None = None
    skip_special_tokens: bool = True
    priority: int = 0  # lower runs first; FCFS among equals
    # vLLM's token rules (executor/token_rules.py), applied wherever the lane samples:
    min_tokens: int = 0  # EOS, stop ids and stop strings cannot end the output before this many tokens
    bad_words: tuple[str, ...] = ()  # each word's tokens (with and without a leading space) never complete
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token
    # Host-side sampling (vLLM's per-request signatures): each processor is
    # fn(output_token_ids, logits) -> logits or fn(prompt_token_ids, output_token_ids, logits),
    # applied in order after the grammar mask, logit bias and penalties; the sampler,
    # fn(output_token_ids, logits) -> token id (or with prompt ids first), picks the token
    # in place of greedy / the seeded draw. Either makes the request's lane a HOST lane.
    logits_processors: Sequence[Callable] = ()
    sampler: Callable | None = None

    def __post_init__(self):
        # Accept lists and a single string for convenience, keep tuples inside.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if callable(self.logits_processors):  # one processor given bare
            object.__setattr__(self, "logits_processors", (self.logits_processors,))
        elif not isinstance(self.logits_processors, tuple):
            object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))

    def with_(self, **kw) -> "SamplingParams":
        return replace(self, **kw)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def host_sampled(self) -> bool:
        """Tokens are picked on the engine's side (a HOST lane)."""
        return bool(self.logits_processors) or self.sampler is not None

    def validate(self, vocab_size: int | None = None, max_n: int = 16) -> None:
        """Raise ParamError for anything outside its range."""
        if not 1 <= self.n <= max_n:
            raise ParamError(f"n must be between 1 and {max_n}, got {self.n}", "n")
        if not 0.0 <= self.temperature <= 2.0:
            raise ParamError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ParamError(f"top_k must be -1 (off) or in [1, {MAX_TOP_K}], got {self.top_k}", "top_k")
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ParamError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {self.priority}", "priority")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ParamError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}", "seed")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ParamError(f"{name} must be in [-2, 2], got {v}", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ParamError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty"
            )
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_TOKENS_CAP:
            raise ParamError(f"max_tokens must be in [1, {MAX_TOKENS_CAP}], got {self.max_tokens}", "max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ParamError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ParamError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
                             "logprobs")

        check_cache_key(self.prompt_cache_key, self.prompt_cache_retention)
        if any(not s for s in self.stop):
            raise ParamError("stop strings must not be empty", "stop")
        if len(self.stop) > MAX_STOP:
            raise ParamError(f"at most {MAX_STOP} stop strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ParamError(f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ParamError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
        for tok, v in self.logit_bias.items():
            if vocab_size is not None and not 0 <= int(tok) < vocab_size:
                raise ParamError(f"logit_bias token id {tok} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias")
            if not -100.0 <= float(v) <= 100.0:
                raise ParamError(f"logit_bias values must be in [-100, 100], got {v} for token {tok}", "logit_bias")
        for i, fn in enumerate(self.logits_processors):
            if not callable(fn):
                raise ParamError(f"logits_processors[{i}] is not callable", "logits_processors")
        if self.sampler is not None and not callable(self.sampler):
            raise ParamError("sampler is not callable", "sampler")
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if not 0 <= tok < vocab_size:
                    raise ParamError(f"stop_token_ids: {tok} is outside the vocabulary", "stop_token_ids")
        self._validate_rules(vocab_size)

    def _validate_rules(self, vocab_size: int | None) -> None:
        if not 0 <= self.min_tokens <= MAX_TOKENS_CAP:
            raise ParamError(f"min_tokens must be in [0, {MAX_TOKENS_CAP}], got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                             "min_tokens")
        if len(self.bad_words) > MAX_BAD_WORDS or any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS
                                                      for w in self.bad_words):
            raise ParamError(f"bad_words: at most {MAX_BAD_WORDS} words, each not blank and at most "
                             f"{MAX_BAD_WORD_CHARS} characters", "bad_words")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
                raise ParamError(f"allowed_token_ids must name 1 to {MAX_ALLOWED_TOKEN_IDS} tokens",
                                 "allowed_token_ids")
            bad = [t for t in allowed if not 0 <= t < (vocab_size if vocab_size is not None else INT32_MAX + 1)]
            if bad:
                raise ParamError(f"allowed_token_ids: {bad[0]} is outside the vocabulary", "allowed_token_ids")

    @property
    def token_rules(self) -> bool:
        """The request has rules its lane applies to every row (a token rules handle)."""
        return self.min_tokens > 0 or bool(self.bad_words) or self.allowed_token_ids is not None

    # ---------------------------------------------------------------- abi side
    def abi_sampling(self) -> int:
        if self.host_sampled:
            return abi.Sampling.HOST
        return abi.Sampling.GREEDY if self.greedy else abi.Sampling.SAMPLE

    def abi_params(self) -> abi.LaneParams:
        return abi.LaneParams(
            temperature=float(self.temperature),
            top_k=int(self.top_k),
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            repeat_penalty=float(self.repetition_penalty),
            presence_penalty=float(self.presence_penalty),
            freq_penalty=float(self.frequency_penalty),
            flags=abi.SamplingFlag.IGNORE_EOS if self.ignore_eos else 0,
        )

    def want_logprobs(self) -> int:
        """The admit's want_logprobs: 0 none, else the chosen token plus k top."""
        return 0 if self.logprobs is None else self.logprobs + 1

    def want_prompt_logprobs(self) -> int:
        return 0 if self.prompt_logprobs is None else self.prompt_logprobs + 1
