"""``--device-graph-mode``: the one flag an engine exposes, and its parsed form.

Accepted values::

    auto                                   every phase uses its platform default
    disabled                               no graphs anywhere (eager)
    full                                   one mode for every phase
    decode=full,prefill=breakable          per phase
    {"decode": "full", "prefill": {"backend": "tc_piecewise", "max_size": 2048, "compiler": "eager"}}
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from devgraph.errors import ConfigError
from devgraph.phases import PHASES
from devgraph.rules import Downgrade, apply_rules

__all__ = ["PhaseConfig", "DeviceGraphConfig", "ResolvedPhase", "add_device_graph_args", "FLAG", "GRAMMAR"]

FLAG = "--device-graph-mode"
GRAMMAR = (
    "auto | disabled | MODE | phase=MODE[,phase=MODE] | JSON object "
    '{"decode": MODE, "prefill": {"backend": MODE, "sizes": [..], "max_size": N, '
    '"compiler": "eager"|"inductor"}}'
)
_SPECIAL_MODES = ("auto", "disabled", "eager")
_PHASE_KEYS = ("backend", "sizes", "max_size", "compiler")
_COMPILERS = ("eager", "inductor")


@dataclass(frozen=True)
class PhaseConfig:
    """What the flag says for one phase; ``None`` fields mean "the engine's or platform's default"."""

    backend: str = "auto"
    sizes: tuple[int, ...] | None = None
    max_size: int | None = None
    compiler: str | None = None


@dataclass(frozen=True)
class ResolvedPhase:
    """A phase's final choice after ``auto`` and the compatibility rules were applied."""

    phase: str
    platform: str
    backend: str
    config: PhaseConfig
    downgrades: tuple[Downgrade, ...] = ()


def _known_modes() -> list[str]:
    from devgraph.plugins import get_registry

    return sorted(set(_SPECIAL_MODES) | set(get_registry().backend_names()))


def _bad(value: Any, what: str, accepted: Iterable[str], source: str) -> ConfigError:
    accepted = list(accepted)
    close = difflib.get_close_matches(str(value), accepted, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"{FLAG} {source!r}: {what} {value!r} is not valid{hint}; accepted: {', '.join(accepted)}"
    )


@dataclass(frozen=True)
class DeviceGraphConfig:
    """The parsed flag: a :class:`PhaseConfig` per phase (missing phases are ``auto``)."""

    phases: Mapping[str, PhaseConfig] = field(default_factory=dict)
    source: str = "auto"

    @classmethod
    def parse(cls, text: str | None, *, known_modes: Iterable[str] | None = None) -> DeviceGraphConfig:
        """Parse a ``--device-graph-mode`` value; :class:`ConfigError` says what is wrong and accepted."""
        source = "auto" if text is None else str(text).strip()
        modes = list(known_modes) if known_modes is not None else _known_modes()
        if not source:
            raise ConfigError(f"{FLAG} is empty; accepted: {GRAMMAR}")
        if source.startswith("{") or source.startswith("["):
            return cls(cls._parse_json(source, modes), source)
        if "=" not in source:
            mode = cls._mode(source, source, modes)
            return cls({p: PhaseConfig(backend=mode) for p in PHASES}, source)
        phases: dict[str, PhaseConfig] = {}
        for item in source.split(","):
            if item.count("=") != 1:
                raise ConfigError(
                    f"{FLAG} {source!r}: {item.strip()!r} is not phase=MODE; accepted: {GRAMMAR}"
                )
            phase, mode = (part.strip() for part in item.split("="))
            cls._phase(phase, source, phases)
            phases[phase] = PhaseConfig(backend=cls._mode(mode, source, modes))
        return cls(phases, source)

    @staticmethod
    def _phase(phase: str, source: str, seen: Mapping[str, Any]) -> None:
        if phase not in PHASES:
            raise _bad(phase, "phase", PHASES, source)
        if phase in seen:
            raise ConfigError(f"{FLAG} {source!r}: phase {phase!r} is given twice; name each phase once")

    @staticmethod
    def _mode(mode: Any, source: str, modes: list[str]) -> str:
        if not isinstance(mode, str) or mode not in modes:
            raise _bad(mode, "mode", modes, source)
        return mode

    @classmethod
    def _parse_json(cls, source: str, modes: list[str]) -> dict[str, PhaseConfig]:
        try:
            data = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{FLAG} {source!r} is not valid JSON ({exc.msg} at column {exc.colno}); accepted: {GRAMMAR}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{FLAG} {source!r}: JSON must be an object keyed by phase; accepted: {GRAMMAR}"
            )
        phases: dict[str, PhaseConfig] = {}
        for phase, value in data.items():
            cls._phase(phase, source, phases)
            phases[phase] = cls._phase_json(phase, value, source, modes)
        return phases

    @classmethod
    def _phase_json(cls, phase: str, value: Any, source: str, modes: list[str]) -> PhaseConfig:
        if isinstance(value, str):
            return PhaseConfig(backend=cls._mode(value, source, modes))
        if not isinstance(value, dict):
            raise ConfigError(
                f"{FLAG} {source!r}: phase {phase!r} must be a mode name or an object with keys "
                f"{', '.join(_PHASE_KEYS)}"
            )
        unknown = set(value) - set(_PHASE_KEYS)
        if unknown:
            raise _bad(sorted(unknown)[0], f"key in phase {phase!r}:", _PHASE_KEYS, source)
        backend = cls._mode(value.get("backend", "auto"), source, modes)
        sizes = value.get("sizes")
        if sizes is not None and (
            not isinstance(sizes, list) or not all(_positive_int(s) for s in sizes) or not sizes
        ):
            raise ConfigError(
                f"{FLAG} {source!r}: {phase}.sizes must be a non-empty list of positive integers, "
                f"got {sizes!r}"
            )
        max_size = value.get("max_size")
        if max_size is not None and not _positive_int(max_size):
            raise ConfigError(
                f"{FLAG} {source!r}: {phase}.max_size must be a positive integer, got {max_size!r}"
            )
        compiler = value.get("compiler")
        if compiler is not None:
            if compiler not in _COMPILERS:
                raise _bad(compiler, f"{phase}.compiler", _COMPILERS, source)
            if backend not in ("tc_piecewise", "auto"):
                raise ConfigError(
                    f"{FLAG} {source!r}: {phase}.compiler applies to tc_piecewise only, "
                    f"but the backend is {backend!r}"
                )
        return PhaseConfig(backend, tuple(sizes) if sizes else None, max_size, compiler)

    def for_phase(self, phase: str) -> PhaseConfig:
        """This phase's settings (``auto`` with defaults when the flag does not name it)."""
        return self.phases.get(phase, PhaseConfig())

    def resolve(self, phase: str, platform: str, features: Mapping[str, Any] | None = None) -> ResolvedPhase:
        """Pick the concrete backend for ``phase`` on ``platform``: ``auto`` -> default, then the rules."""
        from devgraph.factory import resolve_mode
        from devgraph.plugins import get_registry

        registry = get_registry()
        phase_config = self.for_phase(phase)
        backend = resolve_mode(platform, phase, phase_config.backend, registry)
        backend, downgrades = apply_rules(
            phase, backend, {**(features or {}), "platform": platform}, registry.rules
        )
        return ResolvedPhase(phase, platform, backend, phase_config, tuple(downgrades))

    def __str__(self) -> str:
        return self.source


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _argparse_type(text: str) -> DeviceGraphConfig:
    try:
        return DeviceGraphConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_device_graph_args(
    parser: argparse.ArgumentParser, *, default: str = "auto"
) -> argparse.ArgumentParser:
    """Add ``--device-graph-mode`` to an engine's argument parser; the parsed value is a DeviceGraphConfig."""
    parser.add_argument(
        FLAG,
        dest="device_graph_mode",
        type=_argparse_type,
        default=DeviceGraphConfig.parse(default),
        metavar="MODE",
        help=f"device-graph capture per phase: {GRAMMAR} (default: {default})",
    )
    return parser
