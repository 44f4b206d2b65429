"""Set-up steps of a :class:`~devgraph.runner.graph_runner.GraphRunner` that run once: its key schedule, and
learning which outputs are row-major when the captured keys alone cannot tell."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.context import forward_context
from devgraph.contract.inputs import EDGE, StaticInput
from devgraph.contract.keys import REQUESTS, TOKENS, GraphKey
from devgraph.contract.modes import shorten
from devgraph.contract.phases import Phase
from devgraph.errors import ConfigError
from devgraph.flag.config import COMPILING_BACKENDS, DeviceGraphConfig, PhaseConfig
from devgraph.flag.factory import ResolvedPhase, create_backend, resolve_phase, resolve_platform
from devgraph.flag.sizes import resolve_sizes
from devgraph.runner.schedule import AxisSizes, KeySchedule

__all__ = [
    "check_inputs",
    "resolve_backend",
    "runner_device",
    "schedule_for",
    "probe_layout",
    "tokens_per_request_for",
    "warmup_count",
]

logger = logging.getLogger("devgraph.runner")


def resolve_backend(
    phase: str,
    device: torch.device | str | None,
    mode: str | None,
    config: DeviceGraphConfig | str | None,
    compiler: str | None,
    features: Mapping[str, Any] | None,
    backend: DeviceGraphBackend | None,
) -> tuple[DeviceGraphConfig, ResolvedPhase, DeviceGraphBackend]:
    """The runner's parsed flag, its phase's resolution (``auto`` and the rules applied, once) and its
    backend: the one given, or one built for the resolved mode on the device's platform."""
    if mode is not None and config is not None:
        raise ConfigError("pass either mode= (one strategy name) or config= (a --device-graph-mode value)")
    if backend is not None and not isinstance(backend, DeviceGraphBackend):
        raise ConfigError(f"backend= must be a DeviceGraphBackend instance, got {shorten(backend)}")
    platform = backend.platform if backend is not None else resolve_platform(device)
    if not isinstance(config, DeviceGraphConfig):
        config = DeviceGraphConfig.parse(config if config is not None else (mode or "auto"))
    resolved = resolve_phase(config, phase, platform.name, features)
    if backend is None:
        options = resolved.backend_options()
        if compiler is not None and "compiler" not in options and resolved.backend in COMPILING_BACKENDS:
            options["compiler"] = compiler
        backend = create_backend(
            device or platform.default_device(), phase, resolved.backend, options=options
        )
    return config, resolved, backend


def tokens_per_request_for(phase: Phase, given: int | None) -> int | None:
    """Decode: 1; verify: ``1 + k`` (required); prefill/encode: none (requests vary)."""
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
        raise ConfigError(f"tokens_per_request must be a positive int, got {shorten(given)}")
    if phase is Phase.DECODE:
        if given not in (None, 1):
            raise ConfigError(f"decode has one token per request; use phase='verify' for {given} per request")
        return 1
    if phase is Phase.VERIFY:
        if given is None:
            raise ConfigError(
                "the verify phase needs tokens_per_request=1 + k (k draft tokens per request), e.g. 4 for k=3"
            )
        return given
    if given is not None:
        raise ConfigError(
            f"{phase} steps have a varying number of tokens per request; drop tokens_per_request"
        )
    return None


def _free_bytes(runner: Any) -> int | None:
    try:
        return runner.platform.mem_get_info()[0]
    except Exception:  # a platform that cannot tell: the defaults assume plenty
        return None


def _row_bytes(runner: Any) -> int:
    """Static-input bytes per token row (request-axis inputs counted as if one request per token)."""
    return max(
        1,
        sum(
            spec.dtype.itemsize * max(1, int(torch.Size(spec.shape).numel()))
            for spec in runner.input_specs.values()
            if not spec.host
        ),
    )


def _verify_sizes(
    sizes: Sequence[int] | None, max_size: int | None, tpr: int, free: int | None, row_bytes: int
) -> tuple[int, ...]:
    """Verify token sizes: multiples of ``tpr``; the largest always captured (rounded up, never dropped)."""
    if max_size is not None and max_size % tpr:
        rounded = -(-max_size // tpr) * tpr
        logger.warning(
            "devgraph: verify max_size %d is not a multiple of %d tokens per request; capturing up to %d so "
            "the widest speculative batch still replays",
            max_size,
            tpr,
            rounded,
        )
        max_size = rounded
    if sizes is not None:
        bad = [s for s in sizes if isinstance(s, int) and s % tpr]
        if bad:
            raise ConfigError(
                f"verify sizes must be multiples of tokens_per_request={tpr} (whole requests); got {bad}"
            )
        return resolve_sizes(Phase.VERIFY.value, sizes, max_size, free, row_bytes=row_bytes).sizes
    batches = resolve_sizes(
        Phase.DECODE.value,
        None,
        None if max_size is None else max_size // tpr,
        free,
        row_bytes=row_bytes * tpr,
    )
    return tuple(b * tpr for b in batches.sizes)


def schedule_for(
    runner: Any,
    phase_config: PhaseConfig,
    sizes: Sequence[int] | None,
    max_size: int | None,
    axes: Mapping[str, AxisSizes] | None,
    tokens_per_request: int | None,
    variants: Mapping[str, Sequence[Hashable]] | None,
) -> KeySchedule:
    """The runner's keys: token sizes (flag first, then arguments, then defaults), axes and variants."""
    phase = Phase(runner.phase)
    tpr = tokens_per_request_for(phase, tokens_per_request)
    chosen_sizes = phase_config.sizes or sizes
    chosen_max = phase_config.max_size or max_size
    free = _free_bytes(runner)
    row_bytes = _row_bytes(runner)
    if phase is Phase.VERIFY:
        assert tpr is not None
        token_sizes = _verify_sizes(chosen_sizes, chosen_max, tpr, free, row_bytes)
    else:
        token_sizes = resolve_sizes(phase.value, chosen_sizes, chosen_max, free, row_bytes=row_bytes).sizes
    axis_names = [spec.axis for spec in runner.input_specs.values()]
    clashing = sorted(set(variants or {}) & set(runner.input_specs))
    if clashing:
        raise ConfigError(
            f"variants {clashing} share their names with inputs; the forward gets both as keyword "
            "arguments, so rename one"
        )
    return KeySchedule(phase.value, token_sizes, axis_names, axes, tpr, variants)


def _probe_sizes(runner: Any, key: GraphKey) -> dict[str, int]:
    """A size per axis that differs from ``key``'s on that axis and from every other axis's probe size
    (so a leaf following one axis cannot be taken for another), smaller than ``key`` where possible."""
    tpr = runner.tokens_per_request
    step = tpr or 1
    tokens = key.tokens - step if key.tokens > step else key.tokens + step
    sizes = {TOKENS: tokens}
    for axis in key.axis_names:
        if tpr is not None and axis == REQUESTS:
            sizes[axis] = tokens // tpr  # uniform phases: requests follow from tokens
            continue
        current = key.size(axis)
        used = set(sizes.values())
        below = range(current - 1, 0, -1)
        sizes[axis] = next(p for p in itertools.chain(below, itertools.count(current + 1)) if p not in used)
    return sizes


def probe_layout(runner: Any, key: GraphKey) -> None:
    """When the captured keys cannot tell which axis an output leaf follows (every key had one size on an
    axis, or two axes always had the same size), run the forward once more, eagerly, at sizes that differ,
    so a leaf that only happens to match a size is not taken for a row-major output.

    The probe's inputs hold each input's fill (harmless by the fill's contract); declared state is
    restored by the caller. Pass ``output_axes=`` to skip it.
    """
    layout = runner._layout
    if not layout.ambiguous_axes():
        return
    sizes = _probe_sizes(runner, key)
    inputs = {}
    for name, spec in runner.input_specs.items():
        device = torch.device("cpu") if spec.host else runner.device
        fill = 0 if spec.fill == EDGE else spec.fill
        inputs[name] = torch.full(
            (spec.rows(sizes[spec.axis]), *spec.shape), fill, dtype=spec.dtype, device=device
        )
    probe = GraphKey.of(sizes[TOKENS], {a: sizes[a] for a in key.axis_names}, key.variant_dict)
    logger.debug("devgraph: probing output layout of the %s runner at %s", runner.phase, probe)
    try:
        context = runner.capture_context(probe) if runner.capture_context is not None else None
        with forward_context(context), torch.no_grad():
            outputs = runner._graph_forward(**inputs, **key.variant_dict)
    except Exception as exc:  # a forward that only takes certain sizes: learn from the captured keys alone
        logger.warning(
            "devgraph: the %s runner could not run its forward at %s to learn which outputs are row-major "
            "(%s: %s); outputs whose first dimension equals the token count are cut to it. Pass "
            "output_axes= to declare them",
            runner.phase,
            probe,
            type(exc).__name__,
            shorten(str(exc), 160),
        )
        return
    layout.observe(probe, outputs)


def check_inputs(phase: str, inputs: Any, reserved: frozenset[str]) -> dict[str, StaticInput]:
    if not isinstance(inputs, Mapping) or not inputs:
        raise ConfigError(
            f"the {phase} runner needs inputs={{name: StaticInput(...)}} with at least one input, "
            f"got {shorten(inputs)}"
        )
    for name, spec in inputs.items():
        if not isinstance(name, str) or not name.isidentifier() or name in reserved:
            raise ConfigError(
                f"input name {shorten(name)} must be a Python identifier other than run()'s own keywords "
                f"({', '.join(sorted(reserved))})"
            )
        if not isinstance(spec, StaticInput):
            raise ConfigError(f"input {name!r} must be a devgraph.StaticInput, got {shorten(spec)}")
    return dict(inputs)


def runner_device(device: torch.device | str | None, platform: Any) -> torch.device:
    default = platform.default_device()
    if device is None:
        return default
    chosen = torch.device(device)
    if chosen.index is None and chosen.type == default.type:
        return default
    return chosen


def warmup_count(configured: int | None, given: int | None, platform: Any) -> int:
    value = configured if configured is not None else given
    if value is None:
        return int(getattr(platform, "warmup_iters", 2))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 16:
        raise ConfigError(f"warmup_iters must be an int in [0, 16], got {shorten(value)}")
    return value
