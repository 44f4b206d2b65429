"""Which keys a runner captures: token sizes, the buckets of every other axis per token size, variants.

Token sizes come from :mod:`devgraph.flag.sizes` (per phase defaults, ``max_size``, the user's list). Every
other axis an input declares gets, for each token size ``T``, a short list of buckets:

* uniform phases (``decode``, ``verify``: :attr:`~devgraph.contract.phases.PhaseSpec.uniform`):
  ``requests`` is exactly ``T // tokens_per_request``;
* otherwise the default is one bucket, ``T`` (a step never has more requests than tokens), so each token
  size has one graph; an engine narrows it with ``axes={"requests": 64}`` (at most 64 requests: one
  bucket ``min(T, 64)``), a list of buckets for every ``T``, a ``{T: [...]}`` mapping or a function of ``T``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import REQUESTS, TOKENS, GraphKey
from devgraph.contract.phases import Phase
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import ConfigError
from devgraph.flag.config import PhaseConfig
from devgraph.flag.sizes import resolve_sizes
from devgraph.messages import shorten

__all__ = ["AxisSizes", "KeySchedule", "schedule_for", "tokens_per_request_for"]

logger = logging.getLogger(__name__)

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
        for name, given, wanted in (
            ("axes", axes, "a mapping of axis name to its sizes, e.g. {'requests': [1, 4]}"),
            ("variants", variants, "a mapping of variant name to its values, e.g. {'greedy': (False, True)}"),
        ):
            if given is not None and not isinstance(given, Mapping):
                raise ConfigError(f"{phase} runner {name}= must be {wanted}, got {shorten(given)}")
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


def tokens_per_request_for(phase: Phase, given: int | None) -> int | None:
    """The phase's tokens per request (:class:`~devgraph.contract.phases.PhaseSpec`): fixed (decode: 1),
    the engine's (verify: ``1 + k``, required), or none (prefill/encode: requests vary)."""
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
        raise ConfigError(f"tokens_per_request must be a positive int, got {shorten(given)}")
    spec = phase.spec
    if not spec.uniform:
        if given is not None:
            raise ConfigError(
                f"{phase} steps have a varying number of tokens per request; drop tokens_per_request"
            )
        return None
    fixed = spec.tokens_per_request
    if fixed is not None:
        if given not in (None, fixed):
            raise ConfigError(
                f"{phase} has {fixed} token per request; use phase='verify' for {given} per request"
            )
        return fixed
    if given is None:
        raise ConfigError(
            f"the {phase} phase needs tokens_per_request=1 + k (k draft tokens per request), e.g. 4 for k=3"
        )
    return given


def _free_bytes(platform: GraphPlatform) -> int | None:
    try:
        return platform.mem_get_info()[0]
    except Exception:  # a platform that cannot tell: the defaults assume plenty
        return None


def _row_bytes(inputs: Mapping[str, StaticInput]) -> int:
    """Static-input bytes per token row (request-axis inputs counted as if one request per token)."""
    return max(
        1,
        sum(
            spec.dtype.itemsize * max(1, int(torch.Size(spec.shape).numel()))
            for spec in inputs.values()
            if not spec.host
        ),
    )


def _uniform_sizes(
    phase: Phase,
    sizes: Sequence[int] | None,
    max_size: int | None,
    tpr: int,
    free: int | None,
    row_bytes: int,
) -> tuple[int, ...]:
    """Token sizes of a uniform phase: whole requests (multiples of ``tpr``); the largest always captured
    (rounded up, never dropped); by default the phase's request sizes times ``tpr``."""
    if max_size is not None and max_size % tpr:
        rounded = -(-max_size // tpr) * tpr
        logger.warning(
            "devgraph: %s max_size %d is not a multiple of %d tokens per request; capturing up to %d so "
            "the widest batch still replays",
            phase,
            max_size,
            tpr,
            rounded,
        )
        max_size = rounded
    if sizes is not None:
        bad = [s for s in sizes if isinstance(s, int) and s % tpr]
        if bad:
            raise ConfigError(
                f"{phase} sizes must be multiples of tokens_per_request={tpr} (whole requests); got {bad}"
            )
        return resolve_sizes(phase.value, sizes, max_size, free, row_bytes=row_bytes).sizes
    requests = resolve_sizes(
        phase.value, None, None if max_size is None else max_size // tpr, free, row_bytes=row_bytes * tpr
    )
    return tuple(r * tpr for r in requests.sizes)


def _cut_at_tokens(sizes: Sequence[int]) -> Callable[[int], Sequence[int]]:
    """The flag's buckets of an axis, each cut at the token size (no step has more requests than tokens)."""
    return lambda tokens: sorted({min(size, tokens) for size in sizes})


def schedule_for(
    phase: Phase,
    inputs: Mapping[str, StaticInput],
    platform: GraphPlatform,
    settings: PhaseConfig,
    axes: Mapping[str, AxisSizes] | None,
    tokens_per_request: int | None,
    variants: Mapping[str, Sequence[Hashable]] | None,
) -> KeySchedule:
    """A runner's keys: token sizes from its settings (``sizes``, ``max_size``; else the phase's defaults
    under the device's free memory), the buckets of every other axis, and the variants."""
    tpr = tokens_per_request_for(phase, tokens_per_request)
    free = _free_bytes(platform)
    row_bytes = _row_bytes(inputs)
    if tpr is not None:
        token_sizes = _uniform_sizes(phase, settings.sizes, settings.max_size, tpr, free, row_bytes)
    else:
        token_sizes = resolve_sizes(
            phase.value, settings.sizes, settings.max_size, free, row_bytes=row_bytes
        ).sizes
    axis_names = [spec.axis for spec in inputs.values()]
    if settings.axes:  # the flag's buckets (devgraph tune writes them) win over the runner's axes=
        axes = {**(axes or {}), **{axis: _cut_at_tokens(sizes) for axis, sizes in settings.axes}}
    clashing = sorted(set(variants or {}) & set(inputs))
    if clashing:
        raise ConfigError(
            f"variants {clashing} share their names with inputs; the forward gets both as keyword "
            "arguments, so rename one"
        )
    return KeySchedule(phase.value, token_sizes, axis_names, axes, tpr, variants)
