"""Picking each request's next token from its logits: greedy, or seeded temperature + top-p sampling.

Greedy is ``argmax`` (the lowest id among equal maxima). Sampling draws one uniform number per token
from the request's own ``random.Random(seed)`` on the host, then inverts the cumulative distribution of
the top-p set on the device: tokens sorted by probability (a stable sort, so ties keep id order), the
smallest prefix whose mass reaches ``top_p`` kept, and the first token whose cumulative mass exceeds
``u * kept_mass`` chosen. Nothing depends on other rows of the batch or on a global generator, so the
same seed and the same logits give the same token whatever else runs in the step.

A row whose distribution cannot be sampled (logits that are not finite, or a temperature so small that
the scaled logits overflow) falls back to greedy for that row alone: one request's numbers never fail
the other requests of its step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from devgraph.serve.engine.request import Request

__all__ = ["Sampler"]


class Sampler:
    """Samples one token per logits row; one device-to-host copy per call."""

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """``logits [R, V]`` (any float dtype), ``requests[r]`` owns row ``r``."""
        greedy = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not sampled:
            return [int(t) for t in greedy.tolist()]
        device = logits.device
        rows = torch.tensor(sampled, dtype=torch.int64, device=device)
        params = [requests[i].params for i in sampled]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        uniform = torch.tensor(
            [requests[i].rng.random() for i in sampled],  # type: ignore[union-attr]
            dtype=torch.float32,
            device=device,
        )
        picked = _top_p_sample(logits.index_select(0, rows).float(), temperature, top_p, uniform)
        picked = torch.where(picked >= 0, picked, greedy.index_select(0, rows))
        tokens = greedy.index_copy(0, rows, picked)
        return [int(t) for t in tokens.tolist()]


def _top_p_sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """One token per row, or -1 where the row's distribution is not finite (the caller's greedy then)."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    usable = torch.isfinite(probs).all(dim=-1)
    probs = torch.where(usable[:, None], probs, torch.zeros_like(probs))
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    kept = before < top_p[:, None]
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
