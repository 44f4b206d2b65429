"""Picking each request's next token from its logits: greedy, or seeded temperature + top-k + top-p
sampling; and the log probabilities a request asks for.

Greedy is ``argmax`` (the lowest id among equal maxima). Sampling draws one uniform number per token
from the request's own ``random.Random(seed)`` on the host, then inverts the cumulative distribution of
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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from devgraph.serve.engine.grammar import GrammarState, LogitsMasker
from devgraph.serve.engine.request import Request, TokenLogprob

__all__ = ["Sampler"]

#: Rows scored at a time by :meth:`Sampler.token_logprobs` (128 x 152k float32 is 78 MB).
_SCORE_CHUNK = 128


class Sampler:
    """Samples one token per logits row; one device-to-host copy per call (two with logprobs)."""

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """``logits [R, V]`` (any float dtype), ``requests[r]`` owns row ``r``."""
        return self.sample_step(logits, requests)[0]

    def sample_step(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each row's token and, for requests with ``logprobs`` set, its log probabilities."""
        logits = _constrain(logits, requests)
        tokens = self._tokens(logits, requests)
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        host = [int(t) for t in tokens.tolist()]
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if wanted:
            rows = torch.tensor(wanted, dtype=torch.int64, device=logits.device)
            counts = [requests[i].params.logprobs or 0 for i in wanted]
            entries = self.token_logprobs(logits.index_select(0, rows), tokens.index_select(0, rows), counts)
            for i, entry in zip(wanted, entries, strict=True):
                logprobs[i] = entry
        return host, logprobs

    @staticmethod
    def token_logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, counts: Sequence[int]
    ) -> list[TokenLogprob]:
        """Row ``r``'s log probability of ``tokens[r]`` and its ``counts[r]`` most likely tokens, under
        ``log_softmax`` of the float32 logits (sampled tokens, and a prompt's tokens); one host copy.

        A prompt's rows come by the hundred over a vocabulary of 150k: the rows go in chunks (a chunk's
        float32 copy fits the device's cache), and only the log-sum-exp is computed in float32 per chunk;
        the chosen token's rank and the top tokens come from the logits themselves (log_softmax keeps their
        order), so no float32 copy of the whole block is ever made.
        """
        if logits.shape[0] == 0:
            return []
        tokens = tokens.long()
        most = min(max(max(counts, default=0), 1), logits.shape[-1])
        chosen_parts, rank_parts, value_parts, id_parts = [], [], [], []
        for start in range(0, logits.shape[0], _SCORE_CHUNK):
            block = logits[start : start + _SCORE_CHUNK]
            picked = tokens[start : start + _SCORE_CHUNK]
            wide = block.float()
            lse = torch.logsumexp(wide, dim=-1, keepdim=True)
            chosen = wide.gather(1, picked[:, None])
            rank_parts.append((wide > chosen).sum(dim=-1) + 1)
            top_values, top_ids = wide.topk(most, dim=-1)
            chosen_parts.append((chosen - lse)[:, 0])
            value_parts.append(top_values - lse)
            id_parts.append(top_ids)
        # One device-to-host copy for everything (the ids ride as floats: exact below 2**24).
        packed = torch.cat(
            [
                torch.cat(chosen_parts)[:, None],
                torch.cat(rank_parts)[:, None].float(),
                torch.cat(value_parts),
                torch.cat(id_parts).float(),
            ],
            dim=1,
        ).tolist()
        picked_ids = tokens.tolist()
        entries = []
        for r, count in enumerate(counts):
            row = packed[r]
            values, ids = row[2 : 2 + most], row[2 + most :]
            entries.append(
                TokenLogprob(
                    int(picked_ids[r]),
                    float(row[0]),
                    # A grammar's forbidden tokens (-inf) are no alternatives: fewer where it allows fewer.
                    tuple(
                        (int(t), v)
                        for t, v in zip(ids[:count], values[:count], strict=True)
                        if v != -math.inf
                    ),
                    int(row[1]),
                )
            )
        return entries

    def _tokens(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not sampled:
            return greedy
        device = logits.device
        rows = torch.tensor(sampled, dtype=torch.int64, device=device)
        params = [requests[i].params for i in sampled]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.int64, device=device)
        uniform = torch.tensor(
            [requests[i].rng.random() for i in sampled],  # type: ignore[union-attr]
            dtype=torch.float32,
            device=device,
        )
        picked = _sample(logits.index_select(0, rows).float(), temperature, top_p, top_k, uniform)
        picked = torch.where(picked >= 0, picked, greedy.index_select(0, rows))
        return greedy.index_copy(0, rows, picked)


def _constrain(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The logits with each constrained row masked by its grammar (one masker call per tokenizer)."""
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
    return logits


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
