"""``--device-graph-mode``: the one flag an engine exposes, and its parsed form.

This module only parses and validates; choosing a backend from the parsed form (``auto``, compatibility
rules) is :func:`devgraph.flag.factory.resolve_phase`'s job. Accepted values::

    auto                                   every phase uses its platform default
    disabled                               no graphs anywhere (eager)
    full                                   one mode for every phase
    decode=full,prefill=breakable          per phase
    {"decode": {"backend": "full", "compiler": "inductor"}, "prefill": {"backend": "tc_piecewise",
     "max_size": 2048, "compiler": "eager"}, "encode": {"lazy": true, "max_graphs": 16}}

Mode names are checked against the registered backends, which the value checks
(:mod:`devgraph.flag.values`) ask the registry for; this module imports neither the registry nor the
factory.
"""

from __future__ import annotations

import argparse
import json
import reprlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from devgraph.contract.phases import PHASES, Phase
from devgraph.errors import ConfigError
from devgraph.flag.values import (
    PHASE_KEYS,
    ModeNames,
    ModeNamesLookup,
    bad,
    check_combination,
    check_field,
    check_mode,
)
from devgraph.messages import kind, shorten

__all__ = [
    "FLAG",
    "GRAMMAR",
    "DeviceGraphConfig",
    "PhaseConfig",
    "add_device_graph_args",
    "device_graph_mode_type",
]

FLAG = "--device-graph-mode"
GRAMMAR = (
    "auto | disabled | MODE | phase=MODE[,phase=MODE] | JSON object "
    '{"PHASE": MODE | {"backend": MODE, "sizes": [N, ..], "max_size": N, "compiler": "eager"|"inductor", '
    '"inductor_mode": .., "on_recompile": "warn"|"raise", "cache_dir": PATH, "warmup_iters": N, '
    '"lazy": BOOL, "max_graphs": N, "max_graph_bytes": N, "fallback": MODE, "axes": {"AXIS": [N, ..]}}} '
    "(docs/flag.md)"
)
#: The flag's text is bounded before anything parses it (a JSON config of every phase fits easily).
MAX_FLAG_CHARS = 65536
#: ``{"phase": {"key": [..]}}`` is three levels; anything deeper is not a config.
MAX_JSON_DEPTH = 4
#: Integers in the JSON are bounded before ``int()`` sees them (Python refuses over 4300 digits anyway).
MAX_INT_DIGITS = 20


@dataclass(frozen=True)
class PhaseConfig:
    """What the flag says for one phase; ``None`` fields mean "the engine's or platform's default".

    * ``backend``: the mode (``auto``, ``disabled``, ``eager``, ``full``, ``breakable``, ``tc_piecewise``
      or a plug-in's name).
    * ``sizes`` / ``max_size``: what to capture (bounded per phase, see :mod:`devgraph.flag.sizes`).
    * ``compiler`` / ``inductor_mode``: how ``full`` and ``tc_piecewise`` compile the forward.
    * ``on_recompile``: ``warn`` or ``raise`` when torch.compile recompiles after capture.
    * ``cache_dir``: where compile artifacts are kept for warm restarts.
    * ``warmup_iters``: warm-up runs before each capture (0 to 16).
    * ``lazy``: capture each key on first sight instead of at start-up (the encoder cache), bounded by
      ``max_graphs`` graphs and ``max_graph_bytes`` bytes.
    * ``fallback``: a second graph mode whose graphs replay the steps ``backend`` declines (its ``can_run``
      says no, or its capture of that key failed).
    * ``axes``: buckets of the axes other than tokens (``{"requests": [1, 4, 16]}``), each cut at the token
      size (a step never has more requests than tokens); ``devgraph tune`` writes them.
    """

    backend: str = "auto"
    sizes: tuple[int, ...] | None = None
    max_size: int | None = None
    compiler: Literal["eager", "inductor"] | None = None
    inductor_mode: str | None = None
    on_recompile: Literal["warn", "raise"] | None = None
    cache_dir: str | None = None
    warmup_iters: int | None = None
    lazy: bool | None = None
    max_graphs: int | None = None
    max_graph_bytes: int | None = None
    fallback: str | None = None
    axes: tuple[tuple[str, tuple[int, ...]], ...] | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                checked = check_field(f.name, value, f"PhaseConfig.{f.name}", None, None)
                object.__setattr__(self, f.name, checked)
        check_combination({f.name: getattr(self, f.name) for f in fields(self)}, "")

    def backend_options(self) -> dict[str, Any]:
        """The keys a backend takes (``create_backend(options=...)``), without the unset ones."""
        keys = ("compiler", "inductor_mode", "on_recompile", "cache_dir")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def to_json(self) -> dict[str, Any]:
        """The keys that differ from the defaults, as the flag's JSON object (``sizes`` as a list)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value != f.default:
                if f.name == "sizes":
                    value = list(value)
                elif f.name == "axes":
                    value = {axis: list(sizes) for axis, sizes in value}
                out[f.name] = value
        return out


# -- JSON reading with bounds ----------------------------------------------------------------------------
class _JsonObject(dict):  # type: ignore[type-arg]
    """A JSON object that remembers keys given more than once (``json`` keeps the last silently)."""

    duplicates: tuple[str, ...] = ()

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, Any]]) -> _JsonObject:
        obj = cls()
        duplicates = []
        for key, value in pairs:
            if key in obj and key not in duplicates:
                duplicates.append(key)
            obj[key] = value
        obj.duplicates = tuple(duplicates)
        return obj


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ConfigError(
            f"an integer of {digits} digits ({shorten(text, 30)}) is not accepted; integers have at most "
            f"{MAX_INT_DIGITS} digits"
        )
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ConfigError(f"{name} is not a number JSON accepts; give an integer")


def _too_deep(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit`` (checked before ``json`` recurses)."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _load_json(source: str) -> Any:
    if _too_deep(source, MAX_JSON_DEPTH):
        raise ConfigError(
            f"JSON nests deeper than {MAX_JSON_DEPTH} levels; accepted: an object of phases whose values are "
            "a mode or an object of keys"
        )
    try:
        return json.loads(
            source,
            object_pairs_hook=_JsonObject.from_pairs,
            parse_int=_parse_int,
            parse_constant=_reject_constant,
        )
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"is not valid JSON ({exc.msg} at column {exc.colno}); accepted: {GRAMMAR}"
        ) from None
    except RecursionError:  # belt and braces: the depth check above should have caught it
        raise ConfigError(f"JSON nests too deeply; accepted: {GRAMMAR}") from None


# -- the parsed flag -------------------------------------------------------------------------------------
def _check_phase_name(phase: object, seen: Mapping[str, Any]) -> str:
    if not isinstance(phase, (str, Phase)):
        raise ConfigError(
            f"phase names are strings; got {shorten(phase)} ({kind(phase)}); accepted: {', '.join(PHASES)}"
        )
    name = phase.value if isinstance(phase, Phase) else phase
    if name not in PHASES:
        raise bad(name, "phase", PHASES)
    if name in seen:
        raise ConfigError(f"phase {name!r} is given twice; name each phase once")
    return name


def _phase_from_object(phase: str, value: Any, modes: ModeNames) -> PhaseConfig:
    if isinstance(value, str):
        return PhaseConfig(backend=check_mode(value, "mode", modes))
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"phase {phase!r} must be a mode name or an object with keys {', '.join(PHASE_KEYS)}; "
            f"got {shorten(value)} ({kind(value)})"
        )
    duplicates = getattr(value, "duplicates", ())
    if duplicates:
        raise ConfigError(f"key {duplicates[0]!r} is given twice in phase {phase!r}; give each key once")
    values: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str) or key not in PHASE_KEYS:
            raise bad(key, f"key in phase {phase!r}:", PHASE_KEYS)
        if item is None:
            continue  # JSON null: the default, as if the key were absent
        what = f"{phase}.{key}" if key != "backend" else "mode"
        values[key] = check_field(key, item, what, phase, modes)
    check_combination(values, f"{phase}.")
    return PhaseConfig(**values)


@dataclass(frozen=True)
class DeviceGraphConfig:
    """The parsed flag: a :class:`PhaseConfig` per phase (missing phases are ``auto``)."""

    phases: Mapping[str, PhaseConfig] = field(default_factory=dict)
    source: str = "auto"

    @classmethod
    def parse(
        cls,
        value: str | Mapping[str, Any] | DeviceGraphConfig | None,
        *,
        known_modes: Iterable[str] | ModeNamesLookup | None = None,
    ) -> DeviceGraphConfig:
        """Parse a ``--device-graph-mode`` value (text, or a mapping shaped like its JSON form).

        Mode names are checked against ``known_modes`` (names or a function returning them; the special
        modes are always accepted), by default the registered backends. Raises :class:`ConfigError`, one
        line naming the flag, the (shortened) value, what is wrong and what is accepted.
        """
        if isinstance(value, DeviceGraphConfig):
            return value
        modes = ModeNames(known_modes)
        if isinstance(value, Mapping):
            phases = _wrap(_MAPPING_REPR.repr(value), lambda: _phases_from_mapping(value, modes))
            return cls(phases, json.dumps({p: c.to_json() for p, c in phases.items()}))
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"{FLAG} must be a string (or a mapping of phases), got {shorten(value)} ({kind(value)}); "
                f"accepted: {GRAMMAR}"
            )
        if value is not None and len(value) > MAX_FLAG_CHARS:
            raise ConfigError(
                f"{FLAG} {shorten(value)} is {len(value)} characters long; "
                f"at most {MAX_FLAG_CHARS} are accepted"
            )
        source = "auto" if value is None else value.strip()
        return cls(_wrap(source, lambda: _phases_from_text(source, modes)), source)

    def for_phase(self, phase: str) -> PhaseConfig:
        """This phase's settings (``auto`` with defaults when the flag does not name it)."""
        return self.phases.get(Phase.parse(phase).value, PhaseConfig())

    def capped(self, phase: str, limit: int) -> tuple[DeviceGraphConfig, str]:
        """This config with ``phase``'s ``max_size`` at most ``limit`` and its ``sizes`` above ``limit``
        replaced by ``limit`` (the largest step the caller runs still gets its graph), and a description
        of what the flag asked for that was cut (empty when nothing changed), for the caller's warning.

        The flag's sizes win over a runner's own ``max_size``, so an engine that never runs more than
        ``limit`` rows calls this rather than capture graphs no step replays.
        """
        current = self.for_phase(phase)
        changes: dict[str, Any] = {}
        if current.max_size is not None and current.max_size > limit:
            changes["max_size"] = limit
        if current.sizes is not None and max(current.sizes) > limit:
            changes["sizes"] = tuple(sorted({min(size, limit) for size in current.sizes}))
        if not changes:
            return self, ""
        asked = ", ".join(f"{key} {getattr(current, key)!r}" for key in changes)
        phases = {**self.phases, Phase.parse(phase).value: replace(current, **changes)}
        return DeviceGraphConfig(phases, self.source), asked

    def __str__(self) -> str:
        return self.source


#: Shows a bad mapping in an error without walking all of it (a 10**7-entry list stays cheap).
_MAPPING_REPR = reprlib.Repr()
_MAPPING_REPR.maxstring = _MAPPING_REPR.maxother = 40
_MAPPING_REPR.maxdict = _MAPPING_REPR.maxlist = 4


def _wrap(source: str, parse: Callable[[], dict[str, PhaseConfig]]) -> dict[str, PhaseConfig]:
    """Run ``parse``; its :class:`ConfigError` comes back prefixed with the flag and the shortened value."""
    try:
        return parse()
    except ConfigError as exc:
        raise ConfigError(f"{FLAG} {shorten(source)}: {exc}") from None


def _phases_from_text(source: str, modes: ModeNames) -> dict[str, PhaseConfig]:
    if not source:
        raise ConfigError(f"is empty; accepted: {GRAMMAR}")
    if source.startswith(("{", "[")):
        data = _load_json(source)
        if not isinstance(data, Mapping):
            raise ConfigError(f"JSON must be an object keyed by phase; accepted: {GRAMMAR}")
        return _phases_from_mapping(data, modes)
    if "=" not in source:
        mode = check_mode(source, "mode", modes)
        return {p: PhaseConfig(backend=mode) for p in PHASES}
    phases: dict[str, PhaseConfig] = {}
    for item in source.split(","):
        if item.count("=") != 1:
            raise ConfigError(f"{shorten(item.strip())} is not phase=MODE; accepted: {GRAMMAR}")
        phase, mode = (part.strip() for part in item.split("="))
        name = _check_phase_name(phase, phases)
        phases[name] = PhaseConfig(backend=check_mode(mode, "mode", modes))
    return phases


def _phases_from_mapping(data: Mapping[Any, Any], modes: ModeNames) -> dict[str, PhaseConfig]:
    duplicates = getattr(data, "duplicates", ())
    if duplicates:
        raise ConfigError(f"phase {shorten(duplicates[0])} is given twice; name each phase once")
    phases: dict[str, PhaseConfig] = {}
    for phase, value in data.items():
        name = _check_phase_name(phase, phases)
        phases[name] = _phase_from_object(name, value, modes)
    return phases


def device_graph_mode_type(text: str) -> DeviceGraphConfig:
    """argparse ``type=`` for ``--device-graph-mode``: a bad value becomes a one-line usage error."""
    try:
        return DeviceGraphConfig.parse(text)
    except ConfigError as exc:  # argparse names the flag already ("argument --device-graph-mode: ...")
        message = str(exc)
        raise argparse.ArgumentTypeError(message.removeprefix(f"{FLAG} ")) from None


def add_device_graph_args(
    parser: argparse.ArgumentParser, *, default: str = "auto"
) -> argparse.ArgumentParser:
    """Add ``--device-graph-mode`` to an engine's argument parser; the parsed value is a DeviceGraphConfig."""
    parser.add_argument(
        FLAG,
        dest="device_graph_mode",
        type=device_graph_mode_type,
        default=DeviceGraphConfig.parse(default),
        metavar="MODE",
        help=f"device-graph capture per phase: {GRAMMAR} (default: {default})",
    )
    return parser
