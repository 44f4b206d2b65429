"""Capture sizes tuned to recorded traffic: the sizes that pad the fewest rows for a number of graphs.

For one axis, given how many steps had each count (:class:`~devgraph.flag.trace.PhaseSteps`), choose at most
``graphs`` sizes, the largest one covering the largest count seen (or a given ``top``), so that the rows
padded over those steps, ``sum(steps(n) * (bucket(n) - n))``, are as few as possible. The best sizes always
lie on counts that were seen (moving a size down to the largest count it covers only removes padding), so a
dynamic programme over the ``m`` distinct counts is exact: ``best[k][j]``, the least padding of the counts up
to the ``j``-th with ``k`` sizes, the last at the ``j``-th, is the minimum over ``i < j`` of ``best[k-1][i]``
plus the padding of counts ``i+1..j`` into a size at the ``j``-th.

That padding is a Monge cost (moving a bucket's end up never makes a lower start cheaper), so the best ``i``
never decreases as ``j`` grows: each round finds all ``m`` minima by divide and conquer in ``O(m log m)``
(vectorised, one tensor operation per level of the recursion) instead of scanning an ``m x m`` table, and the
rounds stop as soon as one more size stops paying (the least padding is convex in the number of sizes). A
trace of 8192 distinct counts tunes in about a second. Past :data:`MAX_EXACT_COUNTS` distinct counts, counts
are first rounded up to a common step and the result is no longer exact.

A bound on the sum of the sizes (graph memory that grows with each graph's size) is met with a price per unit
of size: the programme is solved at the price where the best solutions above and below the bound tie, which
walks the lower convex hull of (sum of sizes, padding) to the bound in a few solves, then a local search moves
single sizes.

Graph memory: in one shared pool captured largest first, the largest graph holds the pool's peak and each
further graph adds about the same (its own outputs and bookkeeping), so a memory budget is a number of
graphs: :func:`graphs_for_bytes` turns bytes into graphs with the per-key bytes a capture recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from devgraph.contract.keys import REQUESTS, TOKENS, bucket_index
from devgraph.contract.phases import Phase
from devgraph.errors import ConfigError
from devgraph.flag.config import FLAG, DeviceGraphConfig
from devgraph.flag.sizes import MAX_SIZE_COUNT, resolve_sizes
from devgraph.flag.trace import TRACE_FORMAT, PhaseSteps
from devgraph.jsonfile import read_json_file
from devgraph.messages import shorten

__all__ = [
    "MAX_EXACT_COUNTS",
    "AxisTuning",
    "PhaseTuning",
    "apply_tuned",
    "graphs_for_bytes",
    "optimal_sizes",
    "padding_of",
    "read_tuned",
    "tune_phase",
    "tuned_flag",
]

#: Distinct counts the dynamic programme handles exactly (beyond: rounded up to a common step first).
MAX_EXACT_COUNTS = 1 << 14
#: Solves of the priced programme while walking to a size-sum bound (a few suffice; this only caps it).
_MAX_PRICE_SOLVES = 64


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


class _Counts:
    """The candidate sizes ``v`` (ascending) with prefix sums of their steps ``S`` and rows ``R``: the padding
    of counts ``a..j`` into a size at ``v[j]`` is ``v[j] * (S[j+1] - S[a]) - (R[j+1] - R[a])``."""

    def __init__(self, weights: Mapping[int, int]) -> None:
        self.values = sorted(weights)
        self.v = torch.tensor(self.values, dtype=torch.float64)
        steps = torch.tensor([weights[x] for x in self.values], dtype=torch.float64)
        zero = torch.zeros(1, dtype=torch.float64)
        self.steps_upto = torch.cat((zero, torch.cumsum(steps, 0)))  # S[j]: steps of counts 0..j-1
        self.rows_upto = torch.cat((zero, torch.cumsum(steps * self.v, 0)))  # R[j]: their rows

    def __len__(self) -> int:
        return len(self.values)


def _monotone_minima(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every ``j``: the least ``a[i] - x[j] * b[i]`` over ``i < j`` (``inf`` at ``j = 0``) and the first
    ``i`` reaching it. ``x`` ascending and ``b`` non-decreasing make the matrix totally monotone (the best
    ``i`` never decreases with ``j``), so divide and conquer finds every minimum, one tensor pass per level:
    each level's middle rows are searched only between their neighbours' answers."""
    m = a.numel()
    best = torch.full((m,), math.inf, dtype=torch.float64)
    where = torch.zeros(m, dtype=torch.int64)
    if m < 2:
        return best, where
    # Pending row ranges [j_lo, j_hi] and the column range [i_lo, i_hi] their answers lie in.
    j_lo, j_hi = torch.tensor([1]), torch.tensor([m - 1])
    i_lo, i_hi = torch.tensor([0]), torch.tensor([m - 2])
    while j_lo.numel():
        mid = (j_lo + j_hi) // 2
        lengths = torch.minimum(i_hi, mid - 1) - i_lo + 1  # >= 1: i_lo < j_lo <= mid
        ranges = mid.numel()
        owner = torch.repeat_interleave(torch.arange(ranges), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        i = i_lo[owner] + torch.arange(owner.numel()) - starts[owner]
        value = a[i] - x[mid][owner] * b[i]
        low = torch.full((ranges,), math.inf, dtype=torch.float64).scatter_reduce(0, owner, value, "amin")
        first = torch.where(value == low[owner], i, m)
        at = torch.full((ranges,), m, dtype=torch.int64).scatter_reduce(0, owner, first, "amin")
        best[mid], where[mid] = low, at
        left, right = j_lo < mid, mid < j_hi
        j_lo, j_hi, i_lo, i_hi = (
            torch.cat((j_lo[left], mid[right] + 1)),
            torch.cat((mid[left] - 1, j_hi[right])),
            torch.cat((i_lo[left], at[right])),
            torch.cat((at[left], i_hi[right])),
        )
    return best, where


def _solve(counts: _Counts, graphs: int, price: float = 0.0) -> tuple[int, ...]:
    """At most ``graphs`` sizes among the candidates, the largest one last, minimising the padded rows plus
    ``price`` per unit of size (a Lagrange price on the sum of the sizes; 0: padding alone)."""
    m = len(counts)
    if graphs >= m and price == 0.0:
        return tuple(counts.values)
    v, steps_upto, rows_upto = counts.v, counts.steps_upto, counts.rows_upto
    # One more size at j covering counts i+1..j, after a best solution ending at i:
    #   best[i] + v[j] * (S[j+1] - S[i+1]) - (R[j+1] - R[i+1]) + price * v[j]
    #   = own[j] + (best[i] + R[i+1]) - v[j] * S[i+1]
    own = v * steps_upto[1:] - rows_upto[1:] + price * v
    best = own.clone()  # one size: it covers counts 0..j
    totals, choices = [float(best[-1])], []
    for _ in range(min(graphs, m) - 1):
        inner, where = _monotone_minima(best + rows_upto[1:], steps_upto[1:], v)
        best = own + inner
        choices.append(where)
        totals.append(float(best[-1]))
        if totals[-1] >= totals[-2]:  # convex in the number of sizes: no further size pays either
            break
    count = min(range(len(totals)), key=lambda k: (totals[k], k)) + 1  # the fewest sizes among the best
    ends, at = [m - 1], m - 1
    for where in reversed(choices[: count - 1]):
        at = int(where[at])
        ends.append(at)
    return tuple(counts.values[e] for e in sorted(set(ends)))


def optimal_sizes(
    histogram: Mapping[int, int], graphs: int, top: int | None = None, size_sum: int | None = None
) -> tuple[int, ...]:
    """At most ``graphs`` sizes covering every count of ``histogram`` (steps per count) with the fewest
    padded rows; the largest is ``top`` when given (it must hold the largest count), else the largest count.

    ``size_sum`` also bounds the sum of the sizes (graph memory that grows with each graph's size, as a
    forward's outputs kept per key do): the sizes are then the best of the programme with a price per unit of
    size, at the price where the best solutions above and below the bound tie (the lower convex hull of
    sum and padding, walked to the bound), improved by a local search; exact when the bound falls on the hull.
    """
    if isinstance(graphs, bool) or not isinstance(graphs, int) or not 1 <= graphs <= MAX_SIZE_COUNT:
        raise ConfigError(
            f"the number of graphs must be an integer from 1 to {MAX_SIZE_COUNT}, got {graphs!r}"
        )
    weights = _candidates(histogram, top)
    largest = max(weights)
    if size_sum is not None and size_sum < largest:
        raise ConfigError(f"a size budget of {size_sum} is below the largest size {largest}")
    with _one_thread():
        counts = _Counts(weights)
        chosen = _solve(counts, graphs)
        if size_sum is None or sum(chosen) <= size_sum:
            return chosen
        chosen = _within_sum(weights, counts, graphs, size_sum, chosen)
    return _improve(weights, chosen, graphs, size_sum)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The programme's tensors are small (a few thousand elements an operation): one thread is fastest, and
    a second one waiting on a busy core made each operation 60 times slower on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _within_sum(
    weights: Mapping[int, int], counts: _Counts, graphs: int, size_sum: int, over: tuple[int, ...]
) -> tuple[int, ...]:
    """The hull solution with the largest sum of sizes within ``size_sum``: from ``over`` (too large a sum)
    and the largest size alone (the smallest sum), solve at the price where the two tie; a solution better
    than both at that price is a hull point between them and replaces the one on its side of the bound."""

    def point(sizes: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
        return sizes, padding_of(weights, sizes)[0], sum(sizes)

    above, below = point(over), point((max(weights),))
    for _ in range(_MAX_PRICE_SOLVES):
        price = (below[1] - above[1]) / (above[2] - below[2])  # padding saved per unit of size
        found = point(_solve(counts, graphs, price))
        tie = below[1] + price * below[2]
        if found[0] in (above[0], below[0]) or found[1] + price * found[2] >= tie - 1e-9 * max(1.0, tie):
            break
        if found[2] <= size_sum:
            below = found
        else:
            above = found
    return below[0]


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


def read_tuned(path: str | Path) -> DeviceGraphConfig:
    """The sizes of a tuned-sizes file (what ``devgraph tune --out`` writes: ``{"decode": {"sizes": [...]},
    ...}``, ``axes`` beside ``sizes`` where tuned); :class:`ConfigError` naming the file and what is wrong,
    including the likely mix-up: a recorded-steps trace given where its tuned sizes belong."""
    example = '{"decode": {"sizes": [1, 4, 16]}, "prefill": {"sizes": [64, 512]}}'
    expected = f"expected the JSON object devgraph tune --out writes, such as {example}"
    try:
        data = read_json_file(path, "tuned sizes")
    except ConfigError as exc:
        problem = str(exc)
        if not problem.startswith(f"{path}: "):  # unreadable: the reader's words
            raise
        raise ConfigError(
            f"{path} is not a tuned-sizes file ({problem.removeprefix(f'{path}: ')}): {expected}"
        ) from None
    if isinstance(data, Mapping) and (data.get("format") == TRACE_FORMAT or "recorded" in data):
        raise ConfigError(
            f"{path} holds recorded steps, not tuned sizes: run devgraph tune {path} --out tuned.json, then "
            "pass tuned.json"
        )
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{path} is not a tuned-sizes file: {expected}; got {shorten(data)}")
    for phase, settings in data.items():
        if not isinstance(settings, Mapping) or "sizes" not in settings:
            raise ConfigError(
                f"{path}: phase {shorten(phase)} must hold an object with 'sizes' (and 'axes' where tuned), "
                f"as devgraph tune --out writes; got {shorten(settings)}"
            )
        extra = sorted(set(settings) - {"sizes", "axes"})
        if extra:
            raise ConfigError(
                f"{path}: phase {shorten(phase)} sets {', '.join(map(str, extra))}; a tuned-sizes file holds "
                "only sizes (and axes): give the rest with --device-graph-mode"
            )
    text = json.dumps(data)
    try:
        return DeviceGraphConfig.parse(text)
    except ConfigError as exc:  # the flag's own words about a value, said of this file
        raise ConfigError(f"{path}: {str(exc).removeprefix(f'{FLAG} {shorten(text)}: ')}") from None


def apply_tuned(config: DeviceGraphConfig, tuned: str | Path | DeviceGraphConfig) -> DeviceGraphConfig:
    """``config`` with the ``sizes`` (and ``axes``) of a tuned file (``devgraph tune --out``,
    :func:`read_tuned`) put in; its other keys (the mode, ``max_size``, the compiler...) stay as ``config``
    has them."""
    if not isinstance(tuned, DeviceGraphConfig):
        tuned = read_tuned(tuned)
    phases = dict(config.phases)
    for phase, settings in tuned.phases.items():
        if settings.sizes is None:
            continue
        base = config.for_phase(phase)
        phases[phase] = dataclasses.replace(base, sizes=settings.sizes, axes=settings.axes or base.axes)
    return DeviceGraphConfig(phases, json.dumps({p: c.to_json() for p, c in phases.items()}))
