"""Picking each request's next token from its logits: greedy, or seeded temperature + top-k + top-p
sampling; and the log probabilities a request asks for.

Greedy is ``argmax`` (the lowest id among equal maxima). Sampling draws one uniform number per token
from the request's own ``random.Random(seed)`` on the host when the step is issued
(:meth:`Sampler.plan`: the k-th token of a request always takes its k-th number, whichever scheduler runs
it), then inverts the cumulative distribution of
the kept set on the device: tokens sorted by probability (a stable sort, so ties keep id order), the
first ``top_k`` of them (all when 0) and of those the smallest prefix whose mass reaches ``top_p`` kept,
and the first token whose cumulative mass exceeds ``u * kept_mass`` chosen. Nothing depends on other
rows of the batch or on a global generator, so the same seed and the same logits give the same token
whatever else runs in the step.

A row whose distribution cannot be sampled (logits that are not finite, or a temperature so small that
the scaled logits overflow) falls back to greedy for that row alone: one request's numbers never fail
the other requests of its step.

Log probabilities (for requests that ask) are the model's raw distribution, ``log_softmax`` of the
float32 logits before temperature, top-k and top-p (what vLLM returns by default): the sampled token's
and the most likely ones'. :meth:`Sampler.token_logprobs` computes them for any rows and tokens (the
engine scores a prompt's tokens with it).

A request with a grammar (structured output, tool calls; see :mod:`~devgraph.serve.engine.grammar`) has
its row masked first, in :func:`_constrain`, after the graph (so the graphs keep replaying): tokens its
grammar forbids get ``-inf``, for sampling and log probabilities alike (as vLLM does), and are no
alternatives. The masks are computed on the host while the device still runs the step's forward: the
logits are not read before the masks are applied.

A step's sampling is in two halves, so the device never waits for the host: :meth:`Sampler.plan` (host,
when the step is issued: which rows sample, their parameters and uniform numbers, which want log
probabilities: small arrays that travel with the step's inputs) and :func:`sample_on_device` (device,
right after the forward: tokens and log-probability tensors, nothing read back). The engine copies those
to the host without blocking and :func:`logprob_entries` turns them into :class:`TokenLogprob` once read.
:meth:`Sampler.sample_step` does both halves and reads the result at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from devgraph.serve.engine.grammar import GrammarState, LogitsMasker
from devgraph.serve.engine.request import Request, TokenLogprob

__all__ = [
    "LogprobTensors",
    "Sampler",
    "SamplingPlan",
    "logprob_entries",
    "logprob_tensors",
    "sample_on_device",
]

#: The arrays a :class:`SamplingPlan` hands the device (names as they travel in the step's message).
SAMPLING_ARRAYS = ("random_rows", "temperature", "top_p", "top_k", "uniform", "logprob_rows")


@dataclass
class SamplingPlan:
    """One forward's sampling as the host decides it when the step is issued: row ``r`` of the sampled
    logits belongs to ``requests[r]``. ``arrays`` (host tensors, named as in :data:`SAMPLING_ARRAYS`):
    the rows that sample rather than take the greedy token, with their temperature, top-p, top-k and
    uniform number, and the rows that want log probabilities (``logprob_counts``: how many alternatives
    each)."""

    requests: list[Request]
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    logprob_counts: list[int] = field(default_factory=list)

    @property
    def constrained(self) -> bool:
        """Whether a row has a grammar (its mask needs the grammar's state after the previous token)."""
        return any(r.grammar is not None for r in self.requests)


@dataclass
class LogprobTensors:
    """Log probabilities of ``tokens`` under ``log_softmax`` of float32 logits, per row: the token's
    (``chosen``), its rank, and the ``top`` most likely (values and ids); device or host tensors."""

    tokens: torch.Tensor
    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.chosen, self.ranks, self.top_values, self.top_ids)


class Sampler:
    """Samples one token per logits row (see the module docstring)."""

    def plan(self, requests: Sequence[Request]) -> SamplingPlan:
        """The host half: draws each sampling row's uniform number from its request's generator now."""
        plan = SamplingPlan(list(requests))
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            params = [requests[i].params for i in sampled]
            plan.arrays = {
                "random_rows": torch.tensor(sampled, dtype=torch.int64),
                "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32),
                "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32),
                # 0 (every token) travels as 0; the device reads it as the vocabulary's size.
                "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
                "uniform": torch.tensor(
                    [requests[i].rng.random() for i in sampled],  # type: ignore[union-attr]
                    dtype=torch.float32,
                ),
            }
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if wanted:
            plan.arrays["logprob_rows"] = torch.tensor(wanted, dtype=torch.int64)
            plan.logprob_counts = [requests[i].params.logprobs or 0 for i in wanted]
        return plan

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """``logits [R, V]`` (any float dtype), ``requests[r]`` owns row ``r``."""
        return self.sample_step(logits, requests)[0]

    def sample_step(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each row's token and, for requests with ``logprobs`` set, its log probabilities, read at once."""
        plan = self.plan(requests)
        arrays = {name: t.to(logits.device) for name, t in plan.arrays.items()}
        tokens, scored = sample_on_device(logits, plan, arrays)
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if scored is not None:
            rows = plan.arrays["logprob_rows"].tolist()
            host = LogprobTensors(*(t.cpu() for t in scored.tensors()))
            for i, entry in zip(rows, logprob_entries(host, plan.logprob_counts), strict=True):
                logprobs[i] = entry
        return [int(t) for t in tokens.tolist()], logprobs

    @staticmethod
    def token_logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, counts: Sequence[int]
    ) -> list[TokenLogprob]:
        """Row ``r``'s log probability of ``tokens[r]`` and its ``counts[r]`` most likely tokens, under
        ``log_softmax`` of the float32 logits, read at once."""
        scored = logprob_tensors(logits, tokens, max(counts, default=0))
        return logprob_entries(LogprobTensors(*(t.cpu() for t in scored.tensors())), counts)


def sample_on_device(
    logits: torch.Tensor,
    plan: SamplingPlan,
    arrays: Mapping[str, torch.Tensor],
    *,
    greedy: torch.Tensor | None = None,
    write_to: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, LogprobTensors | None]:
    """The device half: ``logits [R, V]`` (row ``r``: ``plan.requests[r]``), ``arrays`` the plan's arrays
    on the logits' device -> the tokens ``[R]`` (int64) and the log-probability tensors of the rows that
    want them; nothing is read back (a grammar's mask is computed on the host, from its current state).

    ``greedy``: each row's argmax of ``logits``, computed already (the decode graph's,
    ``ReferenceModel.decode_step_with_greedy``): used as the greedy tokens unless a request's grammar
    masks its row, which changes the argmax. ``write_to=(target, index)``: each token also goes to
    ``target[index[r]]`` (the engine's token slots)."""
    logits, masked = _constrain(logits, plan.requests)
    tokens = greedy if greedy is not None and not masked else logits.argmax(dim=-1)
    rows = arrays.get("random_rows")
    if rows is not None:
        top_k = arrays["top_k"]
        top_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
        chosen = logits.index_select(0, rows).float()
        picked = _sample(chosen, arrays["temperature"], arrays["top_p"], top_k, arrays["uniform"])
        picked = torch.where(picked >= 0, picked, tokens.index_select(0, rows))
        tokens = tokens.index_copy(0, rows, picked)
    if write_to is not None:
        write_to[0].index_copy_(0, write_to[1], tokens)
    wanted = arrays.get("logprob_rows")
    if wanted is None:
        return tokens, None
    return tokens, logprob_tensors(
        logits.index_select(0, wanted), tokens.index_select(0, wanted), max(plan.logprob_counts, default=0)
    )


#: Bytes of float32 logits :func:`logprob_tensors` works on at a time (a prompt's rows go in chunks).
_SCORE_CHUNK_BYTES = 512 << 20


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, most: int) -> LogprobTensors:
    """Row ``r``'s log probability of ``tokens[r]``, its rank and the ``most`` most likely tokens (at least
    one), under ``log_softmax`` of the float32 logits; on the logits' device, nothing read back.

    A prompt's rows come by the hundred over a vocabulary of 150k: they go in chunks of at most
    :data:`_SCORE_CHUNK_BYTES` of float32, and only the log-sum-exp is subtracted afterwards; the rank and
    the top tokens come from the float32 logits themselves (log_softmax keeps their order), so no float32
    log-softmax of the whole block is made. One alternative (lm-eval's ``logprobs: 1``) is a max, not a
    top-k: a radix top-k over 150k columns costs several times the rest.
    """
    tokens = tokens.long()
    most = min(max(most, 1), logits.shape[-1])
    rows = max(1, _SCORE_CHUNK_BYTES // (4 * max(logits.shape[-1], 1)))
    if logits.shape[0] <= rows:
        return _logprob_chunk(logits, tokens, most)
    parts = [
        _logprob_chunk(logits[start : start + rows], tokens[start : start + rows], most)
        for start in range(0, logits.shape[0], rows)
    ]
    return LogprobTensors(*(torch.cat(column) for column in zip(*(p.tensors() for p in parts), strict=True)))


def _logprob_chunk(logits: torch.Tensor, tokens: torch.Tensor, most: int) -> LogprobTensors:
    wide = logits.float()
    lse = torch.logsumexp(wide, dim=-1, keepdim=True)
    chosen = wide.gather(1, tokens[:, None])
    ranks = (wide > chosen).sum(dim=-1) + 1
    if most == 1:
        top_values, top_ids = wide.max(dim=-1, keepdim=True)
    else:
        top_values, top_ids = wide.topk(most, dim=-1)
    return LogprobTensors(tokens, (chosen - lse)[:, 0], ranks, top_values - lse, top_ids)


def logprob_entries(host: LogprobTensors, counts: Sequence[int]) -> list[TokenLogprob]:
    """:class:`TokenLogprob` per row from host tensors, row ``r`` with ``counts[r]`` alternatives."""
    picked, scores, places, values, ids = (
        t.tolist() for t in (host.tokens, host.chosen, host.ranks, host.top_values, host.top_ids)
    )
    return [
        TokenLogprob(
            int(picked[r]),
            float(scores[r]),
            # A grammar's forbidden tokens (-inf) are no alternatives: fewer where it allows fewer.
            tuple((t, v) for t, v in zip(ids[r][:count], values[r][:count], strict=True) if v != -math.inf),
            int(places[r]),
        )
        for r, count in enumerate(counts)
    ]


def _constrain(logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, bool]:
    """The logits with each constrained row masked by its grammar (one masker call per tokenizer), and
    whether any row was (a masker may write in place, so the tensor alone does not say)."""
    groups: dict[int, tuple[LogitsMasker, list[int], list[GrammarState]]] = {}
    for row, request in enumerate(requests):
        state = request.grammar
        if state is not None:
            masker = state.masker
            _, rows, states = groups.setdefault(id(masker), (masker, [], []))
            rows.append(row)
            states.append(state)
    for masker, rows, states in groups.values():
        logits = masker.mask(logits, rows, states)
    return logits, bool(groups)


def _sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """One token per row, or -1 where the row's distribution is not finite (the caller's greedy then)."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    usable = torch.isfinite(probs).all(dim=-1)
    probs = torch.where(usable[:, None], probs, torch.zeros_like(probs))
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    rank = torch.arange(probs.shape[-1], device=probs.device)
    kept = (before < top_p[:, None]) & (rank[None, :] < top_k[:, None])
    kept[:, 0] = True  # the most likely token always stays, even where top_p rounds to 0 in float32
    kept_probs = sorted_probs * kept
    cumulative = kept_probs.cumsum(dim=-1)
    usable &= cumulative[:, -1] > 0
    target = (uniform * cumulative[:, -1])[:, None]
    index = torch.searchsorted(cumulative, target, right=True)
    last_kept = kept.sum(dim=-1, keepdim=True) - 1
    index = torch.minimum(index, last_kept).clamp_(min=0)
    picked = order.gather(-1, index).squeeze(-1)
    return torch.where(usable, picked, torch.full_like(picked, -1))
