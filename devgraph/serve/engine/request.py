"""A request's parameters, its state inside the engine, and what the engine hands back after each step."""

from __future__ import annotations

import enum
import math
import random
import time
from dataclasses import dataclass, field

from devgraph import InputError
from devgraph.messages import shorten
from devgraph.serve.engine.grammar import Grammar, GrammarState

__all__ = [
    "MAX_COPIES",
    "MAX_LOGPROBS",
    "MAX_STOP_TOKEN_IDS",
    "MIN_TEMPERATURE",
    "MIN_TOP_P",
    "FinishReason",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Status",
    "TokenLogprob",
]

#: The smallest non-zero temperature: logits divided by less overflow float32 (and sample like greedy).
MIN_TEMPERATURE = 1e-4
#: The smallest top_p: below it float32 rounds the kept mass to nothing (and it keeps one token anyway).
MIN_TOP_P = 1e-4
#: Stop token ids per request: every sampled token is checked against them.
MAX_STOP_TOKEN_IDS = 64
#: The most alternatives a request may ask logprobs of (vLLM's default limit; OpenAI's chat allows 20).
MAX_LOGPROBS = 20
#: The most copies one request may sample from its prompt (``n``); each copy takes a running slot.
MAX_COPIES = 64


class FinishReason(str, enum.Enum):
    """Why a request stopped (the OpenAI ``finish_reason`` values, plus ``abort`` and ``error``)."""

    LENGTH = "length"  # max_tokens reached, or the model's context is full
    STOP = "stop"  # a stop token id was sampled (it is not part of the output)
    ABORT = "abort"  # cancelled: the client went away, or the server shut down
    ERROR = "error"  # the step that would have continued it raised

    def __str__(self) -> str:
        return self.value


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy when ``temperature == 0``, else seeded temperature + top-p sampling.

    ``temperature`` is 0 or from :data:`MIN_TEMPERATURE` to 100; ``top_p`` from :data:`MIN_TOP_P` to 1;
    ``top_k`` keeps the ``k`` most likely tokens (0: all); ``seed`` a non-negative int (or ``None``); at
    most :data:`MAX_STOP_TOKEN_IDS` stop token ids. ``logprobs``: ``None`` for none, else the log
    probability of each sampled token under the model's raw distribution (before temperature, top-p and
    top-k) and of the ``logprobs`` most likely tokens, up to :data:`MAX_LOGPROBS`.

    The same ``seed``, prompt and parameters give the same tokens whenever the model's logits are the
    same (always in the engine's ``deterministic`` mode; see :class:`~devgraph.serve.engine.Engine`).
    ``seed=None`` draws a fresh seed per request.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    logprobs: int | None = None
    #: Constrained decoding (structured output, tool calls): each request gets its own state of it.
    grammar: Grammar | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InputError(f"max_tokens must be an int >= 0, got {shorten(self.max_tokens)}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_COPIES:
            raise InputError(f"n must be an int from 1 to {MAX_COPIES}, got {shorten(self.n)}")
        if not _real(self.temperature) or not (
            self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 100
        ):
            raise InputError(
                f"temperature must be 0 (greedy) or a number from {MIN_TEMPERATURE:g} to 100, "
                f"got {shorten(self.temperature)}"
            )
        if not _real(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            raise InputError(f"top_p must be a number from {MIN_TOP_P:g} to 1, got {shorten(self.top_p)}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            # random.Random(seed) uses abs(seed): a negative seed would alias a positive one.
            raise InputError(f"seed must be an int >= 0 (or null), got {shorten(self.seed)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InputError(
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids are accepted, got {len(self.stop_token_ids)}"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise InputError(f"stop token ids must be ints, got {shorten(self.stop_token_ids)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k must be an int >= 0 (0: every token), got {shorten(self.top_k)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise InputError(f"{name} must be an int from 0 to {MAX_LOGPROBS}, got {shorten(value)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Request:
    """One request's state. Its tokens are the prompt, the output known on the host, then ``pending``
    tokens sampled by steps the device may still be running (the overlapped scheduler issues step N+1
    before it reads step N's tokens: they exist only in the device's token slots until then). The first
    ``num_computed`` tokens have keys and values in the cache. ``num_tokens - num_computed`` is what the
    next step must compute: 1 while decoding, more while (re)filling the prompt."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int  # admission order: FCFS, and "newest" when choosing whom to preempt
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admission to the running batch
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    row: int | None = None  # block-table row while running
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    rng: random.Random | None = None
    stop_ids: frozenset[int] = frozenset()  # the params' stop token ids, checked once per sampled token
    grammar: GrammarState | None = None  # this request's place in params.grammar, if any
    #: The id the request was submitted under; a copy of an ``n > 1`` request is ``group.index``.
    group: str = ""
    index: int = 0  # which copy (0 for the first, which computes the prompt)
    #: Copies not yet forked: they take this request's KV blocks when its prompt is computed.
    copies: list[Request] = field(default_factory=list)
    #: The prompt's log probabilities computed so far (``None`` for the first token), when asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: Tokens sampled on the device whose values the host has not read yet (0 or 1 between steps).
    pending: int = 0
    #: Prompt positions whose log probability a step issued so far computes (the list above lags it by
    #: the steps still on the device); a recomputed prompt is not scored again.
    prompt_scored: int = 0

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids)
        self.group = self.group or self.request_id
        if self.params.grammar is not None:  # each request (each copy of an n > 1 one) its own state
            self.grammar = self.params.grammar.start()
        if not self.params.greedy:
            seed = self.params.seed if self.params.seed is not None else random.SystemRandom().getrandbits(64)
            self.rng = random.Random(seed + self.index)
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]
            self.prompt_scored = 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt token's log probability is still to be computed."""
        return self.prompt_logprobs is not None and self.prompt_scored < len(self.prompt)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows: the prompt and the output read back so far."""
        return len(self.prompt) + len(self.output)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def sampled_enough(self) -> bool:
        """Whether the steps issued so far sample every token ``max_tokens`` allows: the request needs no
        step more, and finishes once the host reads them (known before they are read, so an overlapped
        scheduler never gives it a step whose token would be dropped)."""
        return len(self.output) + self.pending >= self.params.max_tokens

    @property
    def remaining(self) -> int:
        """Tokens the next step must compute for this request to sample again."""
        return self.num_tokens - self.num_computed

    def token_at(self, position: int) -> int:
        """The id of a known token (``position < num_known``)."""
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.output[position - n]

    def tokens_from(self, start: int, count: int) -> list[int]:
        """The ids of known tokens ``start .. start + count - 1`` (all below ``num_known``)."""
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n : start - n + count]
        if start + count <= n:
            return self.prompt[start : start + count]
        return self.prompt[start:] + self.output[: start + count - n]


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log probability, its ``rank`` in the distribution (1: the most likely), and the ``top``
    most likely tokens' (id, log probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request: its new token ids (empty on a finish without a token, such
    as a stop token or an abort) and, on the last output, why it finished. ``logprobs``: one entry per
    token id when the request asked for them. ``queue_time``: seconds from arrival to first admission
    (on the last output)."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    ttft: float | None = None  # seconds from arrival to this (first) token
    itl: float | None = None  # seconds since the request's previous token
    logprobs: list[TokenLogprob] | None = None
    queue_time: float | None = None
    #: The id the request was submitted under (its copies' outputs name it too) and this copy's index.
    group: str = ""
    index: int = 0
    #: On a request's first output, when asked for: one entry per prompt token (``None`` for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: On the last output: seconds from first admission to the first token, and from there to the finish.
    prefill_time: float | None = None
    decode_time: float | None = None

    def __post_init__(self) -> None:
        self.group = self.group or self.request_id
