"""Recorded steps: how many steps of each size a runner saw, per phase, as plain data and as a JSON file.

``devgraph tune`` chooses capture sizes from this (:mod:`devgraph.flag.tuning`). A runner records it with
``record_steps=True`` (``stats()["recorded"]``); an engine writes one file for all its phases with
:func:`write_trace`. The file (docs/user-guide.md, "Tuned sizes")::

    {"format": "devgraph-steps", "version": 1,
     "phases": {"decode": {"axes": ["tokens"], "steps": [[1, 120], [3, 41], ...],
                           "sizes": {"tokens": [1, 2, 4, ...]}, "graph_bytes": {"8": 1048576, ...}},
                "prefill": {"axes": ["tokens", "requests"], "steps": [[96, 2, 7], ...]}}}

Each row of ``steps`` holds one count per axis (in ``axes`` order) and, last, how many steps had exactly
those counts. ``sizes`` (optional) is the schedule the runner had, per axis; ``graph_bytes`` (optional) the
bytes each captured token size grew the graph pool by. ``tune`` also reads a ``stats()`` export (one runner's
dict, or a list of them): its ``recorded`` section holds the rows, and the keys it captured or replayed
(``graph_memory.by_key``, ``replays_by_key``: ``"tokens=96,requests=2"``) name the axes and give the token
sizes and their bytes.

Every value is checked, so a hostile file is one :class:`ConfigError` naming it: counts are sizes a phase can
capture (at most :data:`MAX_COUNT`), steps per row at most :data:`MAX_STEPS`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devgraph.contract.keys import TOKENS
from devgraph.contract.phases import PHASES
from devgraph.errors import ConfigError
from devgraph.flag.sizes import HARD_MAX_SIZE
from devgraph.jsonfile import read_json_file
from devgraph.messages import shorten

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "PhaseSteps", "load_steps", "read_steps", "write_trace"]

TRACE_FORMAT = "devgraph-steps"
TRACE_VERSION = 1
#: Rows a file may hold per phase (a histogram of distinct counts; a real trace has thousands at most).
MAX_ROWS = 1 << 20
#: The largest count on any axis: the largest size any phase may capture.
MAX_COUNT = max(HARD_MAX_SIZE.values())
#: The most steps one row may count (a million steps a second for twelve days), so sums stay exact.
MAX_STEPS = 1 << 40


@dataclass
class PhaseSteps:
    """One phase's recorded steps: ``histogram[(tokens, *other axes)] = steps``, in ``axes`` order."""

    phase: str
    axes: tuple[str, ...] = (TOKENS,)
    histogram: Counter[tuple[int, ...]] = field(default_factory=Counter)
    sizes: dict[str, list[int]] = field(default_factory=dict)
    graph_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return sum(self.histogram.values())

    def axis(self, name: str) -> Counter[int]:
        """The marginal histogram of one axis: steps per count of ``name``."""
        i = self.axes.index(name)
        marginal: Counter[int] = Counter()
        for counts, steps in self.histogram.items():
            marginal[counts[i]] += steps
        return marginal

    def merge(self, other: PhaseSteps) -> None:
        if other.axes != self.axes:
            raise ConfigError(
                f"{self.phase} steps were recorded with axes {list(self.axes)} and {list(other.axes)}; "
                "merge traces of runners with the same inputs"
            )
        self.histogram.update(other.histogram)
        self.sizes = self.sizes or other.sizes
        self.graph_bytes = self.graph_bytes or other.graph_bytes

    def to_json(self) -> dict[str, Any]:
        rows = [[*counts, steps] for counts, steps in sorted(self.histogram.items())]
        out: dict[str, Any] = {"axes": list(self.axes), "steps": rows}
        if self.sizes:
            out["sizes"] = self.sizes
        if self.graph_bytes:
            out["graph_bytes"] = {str(k): v for k, v in sorted(self.graph_bytes.items())}
        return out


def _int(value: Any, what: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{what} must be an integer from {low} to {high}, got {shorten(value, 40)}")
    return value


def _phase_from_json(phase: str, data: Any, where: str) -> PhaseSteps:
    if phase not in PHASES:
        raise ConfigError(f"{where}: {shorten(phase)} is not a phase; phases are {', '.join(PHASES)}")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: phase {phase!r} must be an object with 'axes' and 'steps'")
    axes = data.get("axes", [TOKENS])
    if (
        not isinstance(axes, list)
        or not axes
        or axes[0] != TOKENS
        or not all(isinstance(a, str) and a.isidentifier() for a in axes)
        or len(set(axes)) != len(axes)
    ):
        raise ConfigError(f"{where}: {phase}.axes must list axis names, 'tokens' first; got {shorten(axes)}")
    rows = data.get("steps")
    if not isinstance(rows, list) or len(rows) > MAX_ROWS:
        raise ConfigError(f"{where}: {phase}.steps must be a list of at most {MAX_ROWS} rows")
    recorded = PhaseSteps(phase, tuple(axes))
    for row in rows:
        if not isinstance(row, list) or len(row) != len(axes) + 1:
            raise ConfigError(
                f"{where}: each {phase}.steps row holds {len(axes)} counts ({', '.join(axes)}) and a number "
                f"of steps; got {shorten(row)}"
            )
        counts = tuple(_int(c, f"{where}: a {phase} count", 1) for c in row[:-1])
        recorded.histogram[counts] += _int(row[-1], f"{where}: a {phase} number of steps", 0, MAX_STEPS)
    sizes = data.get("sizes") or {}
    if not isinstance(sizes, Mapping):
        raise ConfigError(f"{where}: {phase}.sizes must map an axis to its sizes")
    for axis, values in sizes.items():
        if not isinstance(values, list):
            raise ConfigError(f"{where}: {phase}.sizes[{axis!r}] must be a list of sizes")
        recorded.sizes[str(axis)] = [_int(v, f"{where}: a {phase} size", 1) for v in values]
    graph_bytes = data.get("graph_bytes") or {}
    if not isinstance(graph_bytes, Mapping):
        raise ConfigError(f"{where}: {phase}.graph_bytes must map a token size to bytes")
    for size, nbytes in graph_bytes.items():
        text = str(size)
        if not text.isdigit() or len(text) > 8 or not 1 <= int(text) <= MAX_COUNT:
            raise ConfigError(
                f"{where}: {phase}.graph_bytes keys are token sizes from 1 to {MAX_COUNT}, "
                f"got {shorten(size)}"
            )
        recorded.graph_bytes[int(text)] = _int(nbytes, f"{where}: {phase}.graph_bytes[{text}]", 0, 1 << 62)
    return recorded


def _key_parts(key: Any) -> list[tuple[str, str]]:
    """``"tokens=96,requests=2"`` (a :class:`GraphKey` as ``stats()`` writes it) as (name, value) pairs."""
    return [part.partition("=")[::2] for part in str(key).split(",")]


def _phase_from_stats(stats: Mapping[str, Any], recorded: Any, where: str) -> PhaseSteps:
    """One runner's ``stats()`` export: the rows of ``recorded``; the axes, the token sizes and their bytes
    from the keys it captured (``graph_memory.by_key``) or replayed (``replays_by_key``)."""
    phase = str(stats["phase"])
    if not isinstance(recorded, Mapping):
        raise ConfigError(f"{where}: 'recorded' must be an object with 'steps', got {shorten(recorded)}")
    rows = recorded.get("steps")
    width = len(rows[0]) if isinstance(rows, list) and rows and isinstance(rows[0], list) else 2
    memory = stats.get("graph_memory")
    by_key = memory.get("by_key") if isinstance(memory, Mapping) else None
    by_key = by_key if isinstance(by_key, Mapping) else {}
    replayed = stats.get("replays_by_key")
    keys = [*by_key, *(replayed if isinstance(replayed, Mapping) else {})]
    data = dict(recorded)
    if "axes" not in data and width > 2:
        spelled = (_key_parts(key)[: width - 1] for key in keys)
        named = next(([name for name, _ in parts] for parts in spelled if len(parts) == width - 1), None)
        if named is None:
            raise ConfigError(
                f"{where}: the {phase} runner's stats() records {width - 1} counts a step but names no axes "
                "(it captured and replayed no key); write a trace instead: "
                "devgraph.write_trace(path, [runner.recorded_steps()])"
            )
        data["axes"] = named
    steps = _phase_from_json(phase, data, where)
    # What recorded_steps() adds to a trace: the sizes captured on each axis, the bytes each token size took.
    captured: dict[str, set[int]] = {}
    for key, nbytes in by_key.items():
        parts = dict(_key_parts(key))
        for axis in steps.axes:
            value = parts.get(axis, "")
            if value.isdigit() and len(value) <= 8:
                captured.setdefault(axis, set()).add(int(value))
        tokens = parts.get(TOKENS, "")
        if tokens.isdigit() and len(tokens) <= 8 and type(nbytes) is int and 0 <= nbytes < 1 << 62:
            steps.graph_bytes[int(tokens)] = steps.graph_bytes.get(int(tokens), 0) + nbytes
    for axis, values in captured.items():
        steps.sizes.setdefault(axis, sorted(values))
    return steps


def read_steps(data: Any, where: str = "steps") -> dict[str, PhaseSteps]:
    """Recorded steps per phase from parsed JSON: a trace file's object, one runner's ``stats()`` or a list
    of them (phases seen twice are merged)."""
    found: dict[str, PhaseSteps] = {}

    def add(steps: PhaseSteps) -> None:
        if steps.phase in found:
            found[steps.phase].merge(steps)
        else:
            found[steps.phase] = steps

    if isinstance(data, list):
        for i, item in enumerate(data):
            if not isinstance(item, Mapping):  # a list holds stats() objects, not more lists
                raise ConfigError(
                    f"{where}[{i}] must be a JSON object (a runner's stats()), got {shorten(item)}"
                )
            for steps in read_steps(item, f"{where}[{i}]").values():
                add(steps)
        return found
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where} must be a JSON object (a trace or a runner's stats()), got {shorten(data)}"
        )
    if data.get("format") == TRACE_FORMAT:
        version = data.get("version")
        if version != TRACE_VERSION:
            raise ConfigError(f"{where}: trace version {shorten(version)} is not {TRACE_VERSION}")
        phases = data.get("phases")
        if not isinstance(phases, Mapping):
            raise ConfigError(f"{where}: a trace needs 'phases', an object keyed by phase")
        for phase, item in phases.items():
            add(_phase_from_json(str(phase), item, where))
        return found
    if "recorded" in data and "phase" in data:  # one runner's stats()
        recorded = data["recorded"]
        if recorded is None:
            raise ConfigError(
                f"{where}: the {data['phase']} runner's stats() holds no recorded steps; build the runner "
                "with record_steps=True (or call runner.record_steps(True)) before the traffic to tune for"
            )
        add(_phase_from_stats(data, recorded, where))
        return found
    raise ConfigError(
        f'{where} is neither a {TRACE_FORMAT} trace ("format": {TRACE_FORMAT!r}) nor a runner\'s stats() '
        "with a 'recorded' section"
    )


def load_steps(path: str | Path) -> dict[str, PhaseSteps]:
    """Recorded steps per phase from a trace file or a ``stats()`` JSON export."""
    return read_steps(read_json_file(path, "recorded steps"), str(path))


def write_trace(path: str | Path, phases: Sequence[PhaseSteps] | Mapping[str, PhaseSteps]) -> Path:
    """Write recorded steps of one or more phases as a trace file; returns the path."""
    items = list(phases.values()) if isinstance(phases, Mapping) else list(phases)
    merged: dict[str, PhaseSteps] = {}
    for steps in items:
        if steps.phase in merged:
            merged[steps.phase].merge(steps)
        else:
            merged[steps.phase] = PhaseSteps(
                steps.phase, steps.axes, Counter(steps.histogram), dict(steps.sizes), dict(steps.graph_bytes)
            )
    data = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "phases": {phase: steps.to_json() for phase, steps in merged.items()},
    }
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")  # a reader never sees half a file
    partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, target)
    return target
