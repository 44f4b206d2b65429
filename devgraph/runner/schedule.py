"""Which keys a runner captures: token sizes, the buckets of every other axis per token size, variants.

Token sizes come from :mod:`devgraph.flag.sizes` (per phase defaults, ``max_size``, the user's list). Every
other axis an input declares gets, for each token size ``T``, a short list of buckets:

* uniform phases (``decode``, ``verify``): ``requests`` is exactly ``T // tokens_per_request``;
* otherwise the default is one bucket, ``T`` (a step never has more requests than tokens), so each token
  size has one graph; an engine narrows it with ``axes={"requests": 64}`` (at most 64 requests: one
  bucket ``min(T, 64)``), a list of buckets for every ``T``, a ``{T: [...]}`` mapping or a function of ``T``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from devgraph.contract.keys import REQUESTS, TOKENS, GraphKey
from devgraph.contract.modes import shorten
from devgraph.errors import ConfigError

__all__ = ["AxisSizes", "KeySchedule"]

AxisSizes = int | Sequence[int] | Mapping[int, Sequence[int]] | Callable[[int], Sequence[int]]


def _positive_ints(values: Any, what: str) -> tuple[int, ...]:
    try:
        items = list(values)
    except TypeError:
        raise ConfigError(f"{what} must be a list of positive ints, got {shorten(values)}") from None
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in items):
        raise ConfigError(f"{what} must be a non-empty list of positive ints, got {shorten(values)}")
    return tuple(sorted(set(items)))


class KeySchedule:
    """The keys to capture, largest first, and the buckets :class:`~devgraph.runner.dispatch.Dispatcher`
    uses."""

    def __init__(
        self,
        phase: str,
        token_sizes: Sequence[int],
        axis_names: Sequence[str],
        axes: Mapping[str, AxisSizes] | None = None,
        tokens_per_request: int | None = None,
        variants: Mapping[str, Sequence[Hashable]] | None = None,
    ) -> None:
        self.phase = phase
        self.token_sizes: tuple[int, ...] = tuple(sorted(set(token_sizes)))
        self.tokens_per_request = tokens_per_request
        declared = dict(axes or {})
        unknown = sorted(set(declared) - set(axis_names))
        if unknown:
            raise ConfigError(
                f"{phase} runner axes= names {unknown}, which no StaticInput uses "
                f"(input axes: {sorted(axis_names) or 'tokens only'})"
            )
        self.axis_names: tuple[str, ...] = tuple(sorted(set(axis_names) - {TOKENS}))
        self.buckets: dict[int, dict[str, tuple[int, ...]]] = {
            t: {axis: self._buckets(axis, t, declared.get(axis)) for axis in self.axis_names}
            for t in self.token_sizes
        }
        self.variants: dict[str, tuple[Hashable, ...]] = {}
        for name, values in (variants or {}).items():
            if not isinstance(name, str) or not name.isidentifier() or name in (TOKENS, *self.axis_names):
                raise ConfigError(f"variant name {shorten(name)} must be an identifier that is not an axis")
            if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
                raise ConfigError(
                    f"variant {name!r} takes the values to capture, e.g. (False, True), got {shorten(values)}"
                )
            try:
                chosen = tuple(dict.fromkeys(values))  # hashes every value
            except TypeError:
                raise ConfigError(
                    f"variant {name!r} values must be hashable, got {shorten(values)}"
                ) from None
            if not chosen:
                raise ConfigError(f"variant {name!r} needs at least one value to capture")
            if len({(type(v), v) for v in values}) != len(chosen):
                # 1 and True (or 1 and 1.0) are one dict key: their graphs would be one graph.
                raise ConfigError(
                    f"variant {name!r} has values that compare equal but differ ({shorten(tuple(values))}); "
                    "declare values that are distinct under ==, e.g. only bools or only ints"
                )
            self.variants[name] = chosen

    def _buckets(self, axis: str, tokens: int, sizes: AxisSizes | None) -> tuple[int, ...]:
        tpr = self.tokens_per_request
        if tpr is not None and axis == REQUESTS:
            if sizes is not None:
                raise ConfigError(
                    f"{self.phase} requests follow from tokens ({tpr} per request); "
                    "do not pass axes['requests']"
                )
            return (tokens // tpr,)
        what = f"{self.phase} axes[{axis!r}] for {tokens} tokens"
        if sizes is None:
            return (tokens,)
        if isinstance(sizes, int) and not isinstance(sizes, bool):
            if sizes <= 0:
                raise ConfigError(f"{what}: a maximum must be a positive int, got {sizes}")
            return (min(tokens, sizes),)
        if isinstance(sizes, Mapping):
            if tokens not in sizes:
                raise ConfigError(f"{what}: the mapping has no entry for token size {tokens}")
            return _positive_ints(sizes[tokens], what)
        if callable(sizes):
            return _positive_ints(sizes(tokens), what)
        return _positive_ints(sizes, what)

    # -- queries ------------------------------------------------------------------------------------
    def keys(self) -> list[GraphKey]:
        """Every key to capture, largest first (the order capture uses)."""
        names = list(self.variants)
        combos = [
            dict(zip(names, values, strict=True)) for values in itertools.product(*self.variants.values())
        ]
        keys = []
        for tokens in self.token_sizes:
            per_axis = self.buckets[tokens]
            for sizes in itertools.product(*(per_axis[a] for a in self.axis_names)):
                axes = dict(zip(self.axis_names, sizes, strict=True))
                keys += [GraphKey.of(tokens, axes, variant) for variant in combos or [{}]]
        return sorted(keys, key=GraphKey.sort_key, reverse=True)

    def max_rows(self) -> dict[str, int]:
        """The largest size of every axis over all keys (static buffers are this long)."""
        rows = {TOKENS: self.token_sizes[-1]}
        for axis in self.axis_names:
            rows[axis] = max(max(self.buckets[t][axis]) for t in self.token_sizes)
        return rows

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    def describe(self) -> dict[str, Any]:
        """The schedule as plain data (capture reports and ``inspect()`` show it)."""
        return {
            "token_sizes": list(self.token_sizes),
            "axes": {
                axis: {str(t): list(self.buckets[t][axis]) for t in self.token_sizes}
                for axis in self.axis_names
            },
            "tokens_per_request": self.tokens_per_request,
            "variants": {name: [repr(v) for v in values] for name, values in self.variants.items()},
        }
