"""Capture sizes tuned to recorded traffic: the sizes that pad the fewest rows for a number of graphs.

For one axis, given how many steps had each count (:class:`~devgraph.flag.trace.PhaseSteps`), choose at most
``graphs`` sizes, the largest one covering the largest count seen (or a given ``top``), so that the rows
padded over those steps, ``sum(steps(n) * (bucket(n) - n))``, are as few as possible. The best sizes always
lie on counts that were seen (moving a size down to the largest count it covers only removes padding), so a
dynamic programme over the distinct counts is exact: ``best[k][j]``, the least padding of the counts up to
the ``j``-th with ``k`` sizes, the last at the ``j``-th, is the minimum over ``i`` of ``best[k-1][i]`` plus
the padding of counts ``i+1..j`` into a size at the ``j``-th. Each of the ``graphs`` rounds is one
vectorised minimum over an ``m x m`` table (``m`` distinct counts, at most :data:`MAX_EXACT_COUNTS`; beyond
that, counts are first rounded up to a common step and the result is no longer exact).

Graph memory: in one shared pool captured largest first, the largest graph holds the pool's peak and each
further graph adds about the same (its own outputs and bookkeeping), so a memory budget is a number of
graphs: :func:`graphs_for_bytes` turns bytes into graphs with the per-key bytes a capture recorded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from devgraph.contract.keys import REQUESTS, TOKENS, bucket_index
from devgraph.contract.phases import Phase
from devgraph.errors import ConfigError
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.sizes import MAX_SIZE_COUNT, resolve_sizes
from devgraph.flag.trace import PhaseSteps

__all__ = [
    "MAX_EXACT_COUNTS",
    "AxisTuning",
    "PhaseTuning",
    "apply_tuned",
    "graphs_for_bytes",
    "optimal_sizes",
    "padding_of",
    "tune_phase",
    "tuned_flag",
]

#: Distinct counts the dynamic programme handles exactly (its tables are ``m x m`` int64: 128 MiB at 4096).
MAX_EXACT_COUNTS = 4096
_INF = 1e300  # "impossible" in the float64 tables (padding sums stay exact below 2**53)


def padding_of(histogram: Mapping[int, int], sizes: Sequence[int]) -> tuple[int, int]:
    """``(padded rows, steps past the largest size)`` of ``histogram``'s steps under ``sizes``."""
    ordered = sorted(sizes)
    padded = past = 0
    for count, steps in histogram.items():
        i = bucket_index(ordered, count)
        if i == len(ordered):
            past += steps
        else:
            padded += steps * (ordered[i] - count)
    return padded, past


def _coarsened(histogram: Mapping[int, int]) -> tuple[dict[int, int], int]:
    """``histogram`` with counts rounded up to a multiple of a step that leaves at most
    :data:`MAX_EXACT_COUNTS` distinct counts (step 1: unchanged)."""
    if len(histogram) <= MAX_EXACT_COUNTS:
        return dict(histogram), 1
    step = math.ceil(max(histogram) / MAX_EXACT_COUNTS)
    rounded: dict[int, int] = {}
    for count, steps in histogram.items():
        up = -(-count // step) * step
        rounded[up] = rounded.get(up, 0) + steps
    return rounded, step


def _candidates(histogram: Mapping[int, int], top: int | None) -> dict[int, int]:
    """Steps per candidate size: the counts seen (rounded when there are too many) and ``top``."""
    seen = {int(c): int(s) for c, s in histogram.items() if s > 0}
    if not seen:
        raise ConfigError("no recorded steps to tune for; record some traffic first")
    largest = max(seen)
    if top is not None and top < largest:
        raise ConfigError(f"the largest size {top} is below the largest recorded count {largest}")
    weights, _ = _coarsened(seen)
    if top is not None:
        weights.setdefault(top, 0)  # covers nothing seen, but must be a size (it ends the list)
    return weights


def _solve(weights: Mapping[int, int], graphs: int, price: float = 0.0) -> tuple[int, ...]:
    """At most ``graphs`` sizes among ``weights``' counts, the largest one last, minimising the padded rows
    plus ``price`` per unit of size (a Lagrange price on the sum of the sizes; 0: padding alone)."""
    values = sorted(weights)
    m = len(values)
    if graphs >= m and price == 0.0:
        return tuple(values)
    v = torch.tensor(values, dtype=torch.float64)
    h = torch.tensor([weights[x] for x in values], dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    steps_upto = torch.cat((zero, torch.cumsum(h, 0)))  # steps of counts 0..j-1
    rows_upto = torch.cat((zero, torch.cumsum(h * v, 0)))  # rows of counts 0..j-1
    i = torch.arange(m)[:, None]
    j = torch.arange(m)[None, :]
    # cost[i, j]: padding of counts i..j into a size at values[j], plus its price (impossible when i > j).
    cost = v[None, :] * (steps_upto[j + 1] - steps_upto[i]) - (rows_upto[j + 1] - rows_upto[i]) + price * v
    cost = torch.where(i <= j, cost, torch.full_like(cost, _INF))
    best = cost[0].clone()  # one size: it covers counts 0..j
    totals, choices = [float(best[-1])], []
    for _ in range(min(graphs, m) - 1):
        table = best[:-1, None] + cost[1:, :]  # previous size at i, this one covers i+1..j
        new, where = table.min(dim=0)
        best = torch.cat((torch.full((1,), _INF, dtype=torch.float64), new[1:])).clamp_(max=_INF)
        choices.append(torch.cat((torch.zeros(1, dtype=torch.int64), where[1:])))
        totals.append(float(best[-1]))
    count = min(range(len(totals)), key=lambda k: (totals[k], k)) + 1  # the fewest sizes among the best
    ends, at = [m - 1], m - 1
    for where in reversed(choices[: count - 1]):
        at = int(where[at])
        ends.append(at)
    return tuple(values[e] for e in sorted(set(ends)))


def optimal_sizes(
    histogram: Mapping[int, int], graphs: int, top: int | None = None, size_sum: int | None = None
) -> tuple[int, ...]:
    """At most ``graphs`` sizes covering every count of ``histogram`` (steps per count) with the fewest
    padded rows; the largest is ``top`` when given (it must hold the largest count), else the largest count.

    ``size_sum`` also bounds the sum of the sizes (graph memory that grows with each graph's size, as a
    forward's outputs kept per key do): the sizes are then the best the dynamic programme finds with a price
    per unit of size, the price found by bisection (the least padding among the prices tried whose sizes
    fit; exact for the budgets those prices reach).
    """
    if isinstance(graphs, bool) or not isinstance(graphs, int) or not 1 <= graphs <= MAX_SIZE_COUNT:
        raise ConfigError(
            f"the number of graphs must be an integer from 1 to {MAX_SIZE_COUNT}, got {graphs!r}"
        )
    weights = _candidates(histogram, top)
    chosen = _solve(weights, graphs)
    if size_sum is None or sum(chosen) <= size_sum:
        return chosen
    largest = max(weights)
    if size_sum < largest:
        raise ConfigError(f"a size budget of {size_sum} is below the largest size {largest}")
    low, high = 0.0, float(sum(weights.values()) * largest + 1)
    fit: tuple[int, ...] = (largest,)
    for _ in range(40):
        price = (low + high) / 2
        sizes = _solve(weights, graphs, price)
        if sum(sizes) <= size_sum:
            high = price
            if padding_of(weights, sizes)[0] < padding_of(weights, fit)[0]:
                fit = sizes
        else:
            low = price
    return _improve(weights, fit, graphs, size_sum)


#: Rounds of the local search after the priced programme (each tries every move of one size).
_IMPROVE_ROUNDS = 8


def _improve(
    weights: Mapping[int, int], sizes: tuple[int, ...], graphs: int, size_sum: int
) -> tuple[int, ...]:
    """Close some of the gap a price leaves: move one size to another candidate, or add one, while the
    result fits both bounds and pads fewer rows; until no move helps (a few rounds at most)."""
    candidates = sorted(weights)
    if len(candidates) > 256:  # each round costs candidates x sizes paddings
        return sizes
    current, padded = list(sizes), padding_of(weights, sizes)[0]
    for _ in range(_IMPROVE_ROUNDS):
        best = None
        keep_last = current[-1]
        options = [[*current[:k], *current[k + 1 :]] for k in range(len(current) - 1)]
        if len(current) < graphs:
            options.append(list(current))
        for base in options:
            room = size_sum - sum(base)
            for value in candidates:
                if value >= keep_last or value > room or value in base:
                    continue
                trial = sorted([*base, value])
                score = padding_of(weights, trial)[0]
                if score < padded and (best is None or score < best[0]):
                    best = (score, trial)
        if best is None:
            break
        padded, current = best
    return tuple(current)


def graphs_for_bytes(budget: int, graph_bytes: Mapping[int, int]) -> int:
    """How many graphs fit ``budget`` bytes of graph memory, from the bytes each captured size grew the pool
    by (largest first): the largest's bytes once, then the median of the others per further graph."""
    if not graph_bytes:
        raise ConfigError(
            "a graph-memory budget needs the bytes each captured key took (a trace recorded from a runner "
            "that captured, with 'graph_bytes'); or give a number of graphs instead"
        )
    largest = graph_bytes[max(graph_bytes)]
    others = [b for size, b in graph_bytes.items() if size != max(graph_bytes)]
    each = max(1, int(statistics.median(others))) if others else max(1, largest)
    if budget < largest:
        raise ConfigError(f"a graph-memory budget of {budget} bytes is below the largest graph's {largest}")
    return min(MAX_SIZE_COUNT, 1 + (budget - largest) // each)


@dataclass(frozen=True)
class AxisTuning:
    """Tuned sizes of one axis, with the padding they and the baseline sizes give on the recorded steps."""

    axis: str
    sizes: tuple[int, ...]
    padded: int
    real: int
    baseline: tuple[int, ...]
    baseline_padded: int
    baseline_past: int  # recorded steps past the baseline's largest size (they ran eagerly)
    exact: bool

    @property
    def cut(self) -> float:
        """Share of the baseline's padded rows the tuned sizes remove (1.0: all of them)."""
        return 1.0 - self.padded / self.baseline_padded if self.baseline_padded else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "axis": self.axis,
            "sizes": list(self.sizes),
            "padded_rows": self.padded,
            "real_rows": self.real,
            "sizes_sum": sum(self.sizes),
            "baseline_sizes": list(self.baseline),
            "baseline_sizes_sum": sum(self.baseline),
            "baseline_padded_rows": self.baseline_padded,
            "baseline_steps_past_largest": self.baseline_past,
            "padding_cut": round(self.cut, 4),
            "exact": self.exact,
        }


@dataclass(frozen=True)
class PhaseTuning:
    phase: str
    steps: int
    axes: tuple[AxisTuning, ...]

    def axis(self, name: str) -> AxisTuning:
        return next(a for a in self.axes if a.axis == name)


def _baseline(steps: PhaseSteps, axis: str, top: int) -> tuple[int, ...]:
    """What the steps ran with: the recorded schedule, else the phase's default sizes up to ``top``."""
    recorded = steps.sizes.get(axis)
    if recorded:
        return tuple(sorted(set(recorded)))
    if axis == TOKENS:
        return resolve_sizes(steps.phase, None, top).sizes
    return (top,)


def _tune_axis(
    steps: PhaseSteps, axis: str, graphs: int | None, top: int | None, size_sum: int | None = None
) -> AxisTuning:
    histogram = steps.axis(axis)
    largest = max(histogram)
    baseline = _baseline(steps, axis, max(top or 0, largest))
    if graphs is None and size_sum is None:
        # Equal graph memory whichever way it grows: no more graphs, and no larger sum of sizes.
        graphs, size_sum = len(baseline), max(sum(baseline), top or largest)
    sizes = optimal_sizes(histogram, graphs if graphs is not None else MAX_SIZE_COUNT, top, size_sum)
    padded, _ = padding_of(histogram, sizes)
    base_padded, base_past = padding_of(histogram, baseline)
    real = sum(c * s for c, s in histogram.items())
    exact = len(histogram) <= MAX_EXACT_COUNTS
    return AxisTuning(axis, sizes, padded, real, baseline, base_padded, base_past, exact)


def tune_phase(
    steps: PhaseSteps,
    *,
    graphs: int | None = None,
    graph_bytes: int | None = None,
    size_sum: int | None = None,
    top: int | None = None,
    axis_graphs: Mapping[str, int] | None = None,
) -> PhaseTuning:
    """Tuned token sizes of one phase (and, for each axis named in ``axis_graphs``, that axis's buckets).

    The budget: ``graphs`` token sizes, or as many as ``graph_bytes`` affords (:func:`graphs_for_bytes`),
    and/or a bound ``size_sum`` on the sum of the sizes; with none given, as many sizes as the baseline had
    (the recorded schedule, or the phase's defaults) and no larger sum of sizes: equal graph memory, whether
    a runner's graph memory follows its number of graphs or its graphs' sizes.
    """
    if not steps.histogram:
        raise ConfigError(f"no {steps.phase} steps were recorded; nothing to tune")
    if graphs is None and graph_bytes is not None:
        graphs = graphs_for_bytes(graph_bytes, steps.graph_bytes)
    tuned = [_tune_axis(steps, TOKENS, graphs, top, size_sum)]
    uniform = Phase.parse(steps.phase).uniform
    for axis, count in (axis_graphs or {}).items():
        if axis not in steps.axes or axis == TOKENS:
            raise ConfigError(
                f"{steps.phase} steps were recorded with axes {list(steps.axes)}; cannot tune axis {axis!r}"
            )
        if uniform and axis == REQUESTS:
            raise ConfigError(f"{steps.phase} requests follow from tokens; tune the token sizes only")
        tuned.append(_tune_axis(steps, axis, count, None))
    return PhaseTuning(steps.phase, steps.steps, tuple(tuned))


def tuned_flag(tunings: Sequence[PhaseTuning]) -> dict[str, dict[str, object]]:
    """The tuned sizes as the ``--device-graph-mode`` JSON object (``sizes``, and ``axes`` for other axes)."""
    flag: dict[str, dict[str, object]] = {}
    for tuning in tunings:
        phase: dict[str, object] = {"sizes": list(tuning.axis(TOKENS).sizes)}
        others = {a.axis: list(a.sizes) for a in tuning.axes if a.axis != TOKENS}
        if others:
            phase["axes"] = others
        flag[tuning.phase] = phase
    return flag


def apply_tuned(config: DeviceGraphConfig, tuned: str | Path | DeviceGraphConfig) -> DeviceGraphConfig:
    """``config`` with the ``sizes`` (and ``axes``) of a tuned file (``devgraph tune --out``) put in; its
    other keys (the mode, ``max_size``, the compiler...) stay as ``config`` has them."""
    if not isinstance(tuned, DeviceGraphConfig):
        path = Path(tuned)
        try:
            text = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read tuned sizes from {path}: {exc.strerror or exc}") from None
        if not text.startswith("{"):
            raise ConfigError(
                f"{path} is not a tuned-sizes file: expected the JSON object devgraph tune writes"
            )
        tuned = DeviceGraphConfig.parse(text)
    phases = dict(config.phases)
    for phase, settings in tuned.phases.items():
        if settings.sizes is None:
            continue
        base = config.for_phase(phase)
        phases[phase] = dataclasses.replace(base, sizes=settings.sizes, axes=settings.axes or base.axes)
    return DeviceGraphConfig(phases, json.dumps({p: c.to_json() for p, c in phases.items()}))
