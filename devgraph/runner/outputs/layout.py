"""What a forward returns, and how every path hands the same structure and shapes back to the caller.

Outputs are pytrees (:mod:`devgraph.runner.outputs.trees`). Which tensor leaves are *row-major* (one row
per token, or per request, so a padded step must be cut back to the real count) is known per leaf:
declared with ``output_axes=`` or inferred once at capture by comparing the leaf's first dimension across
keys of different sizes, never guessed per call.

Ownership, one rule on every path: what ``run()`` returns is valid until the next ``run()`` of the same
runner (graph steps return views of the graph's static outputs). ``copy=True`` returns tensors the caller
owns; ``out=`` copies into tensors the caller provides (e.g. pinned host memory) with no second copy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from devgraph.contract.keys import TOKENS, GraphKey
from devgraph.errors import CaptureError, ConfigError
from devgraph.messages import shorten
from devgraph.runner.outputs.trees import flatten, leaf_paths, same_structure

__all__ = ["OutputLayout", "check_output_axes", "parse_row_axis"]


#: A row-major leaf: the axis its first dimension follows and the rows it has beyond that axis's count
#: (``cu_seqlens``-like outputs have ``requests + 1``).
RowAxis = tuple[str, int]

_ROW_AXIS = re.compile(r"^([A-Za-z_]\w*)(?:\+(\d+))?$")


def parse_row_axis(text: str) -> RowAxis:
    """``"tokens"`` -> ``("tokens", 0)``; ``"requests+1"`` -> ``("requests", 1)``."""
    match = _ROW_AXIS.match(text)
    if match is None:
        raise ConfigError(
            f"output_axes entry {shorten(text)} must be an axis name, optionally with extra rows "
            "('tokens', 'requests', 'requests+1'), or None"
        )
    return match.group(1), int(match.group(2) or 0)


def _row_text(row: RowAxis | None) -> str | None:
    if row is None:
        return None
    axis, extra = row
    return f"{axis}+{extra}" if extra else axis


class OutputLayout:
    """Per tensor leaf of a forward's outputs: the axis its first dimension follows (or ``None``).

    Built once at capture from the outputs of every captured key (``observe``), or from ``output_axes``.
    A leaf follows an axis when, at every observed key, its first dimension is that axis's size plus the
    same number of extra rows (0 first, tokens before other axes); telling that apart from a fixed-size
    leaf needs two sizes of the axis, and telling two axes apart needs a key where their sizes differ, so
    the runner probes one more size when the keys cannot tell (:meth:`ambiguous_axes`).
    ``slice`` cuts the row-major leaves of a replay's outputs to the step's real counts.

    ``same_as_tokens``: axes whose count always equals the token count (``requests`` in decode), which
    never need telling apart from ``tokens``.
    """

    def __init__(
        self,
        declared: Sequence[str | None] | Mapping[str, str | None] | None = None,
        same_as_tokens: frozenset[str] = frozenset(),
    ) -> None:
        self.declared = declared
        self.same_as_tokens = same_as_tokens
        self.rows: tuple[RowAxis | None, ...] | None = None
        self.spec: pytree.TreeSpec | None = None
        self.paths: list[str] = []
        self._shapes: dict[GraphKey, list[tuple[int, ...] | None]] = {}
        # Per key, the captured outputs' leaves: each step rebuilds a fresh container from them, so a
        # caller who edits the container it got (pops a key, replaces a leaf) changes no later step.
        self._leaves: dict[GraphKey, list[Any]] = {}

    @property
    def axes(self) -> tuple[str | None, ...] | None:
        """The axis each leaf follows (``None``: not row-major); ``None`` until the layout is known."""
        return None if self.rows is None else tuple(r[0] if r else None for r in self.rows)

    # -- learning the layout ------------------------------------------------------------------------
    def observe(self, key: GraphKey, outputs: Any) -> None:
        """Record the leaf shapes a capture of ``key`` produced (the structure must not change)."""
        leaves, spec = flatten(outputs)
        if self.spec is None:
            self.spec = spec
            self.paths = leaf_paths(outputs, len(leaves))
        elif not same_structure(spec, self.spec):
            raise ConfigError(
                f"the forward returned a different output structure for {key} than for other keys "
                f"({shorten(spec, 200)} vs {shorten(self.spec, 200)}); "
                "return the same structure for every size"
            )
        self._shapes[key] = [
            tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() else None for t in leaves
        ]

    def ambiguous_axes(self) -> list[str]:
        """Axes the observed keys cannot tell a leaf's rows by: one size only, or always the same size as
        another axis. Empty when declared, or when no leaf has a leading dimension."""
        if self.declared is not None or not self._shapes:
            return []
        if not any(shape is not None for shapes in self._shapes.values() for shape in shapes):
            return []
        keys = list(self._shapes)
        names = [TOKENS, *keys[0].axis_names]
        ambiguous = [a for a in names if len({k.size(a) for k in keys}) < 2]
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                linked = a == TOKENS and b in self.same_as_tokens
                if not linked and all(k.size(a) == k.size(b) for k in keys):
                    ambiguous += [x for x in (a, b) if x not in ambiguous]
        return ambiguous

    def finish(self) -> None:
        """Fix each leaf's rows from the declaration or from the observed shapes."""
        declared = self._declared_rows()
        if declared is not None:
            self._check_declared(declared)
            self.rows = declared
            return
        if not self._shapes:
            return
        keys = list(self._shapes)
        names = [TOKENS, *keys[0].axis_names]
        rows: list[RowAxis | None] = []
        for i in range(len(self._shapes[keys[0]])):
            dims = [(shape[0] if (shape := self._shapes[k][i]) is not None else -1, k) for k in keys]
            candidates = []
            for order, axis in enumerate(names):
                extras = {dim - k.size(axis) for dim, k in dims}
                if len(extras) != 1 or (extra := extras.pop()) < 0:
                    continue
                # With one size of the axis seen, extra rows cannot be told from a fixed size: exact only.
                if extra == 0 or len({k.size(axis) for k in keys}) > 1:
                    candidates.append((extra, order, axis))
            best = min(candidates, default=None)
            rows.append((best[2], best[0]) if best is not None else None)
        self.rows = tuple(rows)

    def _declared_rows(self) -> tuple[RowAxis | None, ...] | None:
        declared = self.declared
        if declared is None or self.spec is None:
            return None
        count = self.spec.num_leaves
        if isinstance(declared, Mapping):
            paths = self.paths
            unknown = sorted(set(declared) - set(paths))
            if unknown:
                raise ConfigError(f"output_axes names {unknown}, not output leaves; the leaves are {paths}")
            entries = [declared.get(p) for p in paths]
        else:
            entries = list(declared)
            if len(entries) != count:
                raise ConfigError(
                    f"output_axes has {len(entries)} entries but the forward returns {count} leaves "
                    f"({self.paths})"
                )
        rows = tuple(None if e is None else parse_row_axis(e) for e in entries)
        known = {TOKENS, *next(iter(self._shapes)).axis_names} if self._shapes else {TOKENS}
        unknown_axes = sorted({r[0] for r in rows if r is not None} - known)
        if unknown_axes:
            raise ConfigError(
                f"output_axes names axes {unknown_axes}; this runner's axes are {sorted(known)}"
            )
        return rows

    def _check_declared(self, rows: tuple[RowAxis | None, ...]) -> None:
        """A declared row axis must match every captured key's leading dimension."""
        for key, shapes in self._shapes.items():
            for path, row, shape in zip(self.paths, rows, shapes, strict=True):
                if row is None:
                    continue
                want = key.size(row[0]) + row[1]
                if shape is None or shape[0] != want:
                    got = "no leading dimension" if shape is None else f"{shape[0]} rows"
                    axis = row[0] + (f"+{row[1]}" if row[1] else "")
                    raise CaptureError(
                        f"capturing {key} gave output {path or '(the output)'} {got}, but output_axes says "
                        f"it follows {axis} ({want} rows at this key): fix output_axes (None for outputs "
                        "whose first dimension is not one row per token or request), or the backend captured "
                        "another shape than the key's",
                        size=key.tokens,
                    )

    def forget(self, key: GraphKey) -> None:
        self._shapes.pop(key, None)
        self._leaves.pop(key, None)

    # -- per step -----------------------------------------------------------------------------------
    def slice(self, outputs: Any, counts: Mapping[str, int], key: GraphKey, *, replay: bool = True) -> Any:
        """``outputs`` of ``key`` in a fresh container, every row-major leaf cut to the step's real count.

        ``replay``: the outputs are the graph's own (the same objects every replay); their leaves are read
        once per key. Otherwise (an eager run on the padded buffers) they are read each time.
        """
        if isinstance(outputs, torch.Tensor):
            row = self.rows[0] if self.rows else None
            if row is None or counts[row[0]] == key.size(row[0]):
                return outputs
            return outputs[: counts[row[0]] + row[1]]
        leaves = self._leaves.get(key) if replay else None
        if leaves is None:  # the first replay: the graph's own container, never handed out itself
            leaves = pytree.tree_flatten(outputs)[0]
            if replay:
                self._leaves[key] = leaves
        spec = self.spec if self.spec is not None else pytree.tree_flatten(outputs)[1]
        rows = self.rows
        if rows is None or not any(rows):
            return pytree.tree_unflatten(list(leaves), spec)
        cut = [
            leaf[: counts[row[0]] + row[1]] if row is not None and isinstance(leaf, torch.Tensor) else leaf
            for leaf, row in zip(leaves, rows, strict=True)
        ]
        return pytree.tree_unflatten(cut, spec)

    def describe(self) -> dict[str, Any]:
        if self.spec is None:
            return {"leaves": 0}
        paths = self.paths
        rows = self.rows or (None,) * len(paths)
        return {
            "leaves": len(paths),
            "row_axes": {p: _row_text(r) for p, r in zip(paths, rows, strict=True)},
            "declared": self.declared is not None,
        }


def check_output_axes(value: Any) -> Any:
    """Validate the shape of ``output_axes=`` before any capture."""
    if value is None:
        return None
    items = value.values() if isinstance(value, Mapping) else value
    if not isinstance(value, (Mapping, list, tuple)) or not all(
        a is None or isinstance(a, str) for a in items
    ):
        raise ConfigError(
            "output_axes must be a list (one entry per output leaf) or a mapping from leaf path to an axis "
            f"name or None, got {shorten(value)}"
        )
    for entry in items:
        if entry is not None:
            parse_row_axis(entry)
    return value
