"""The values a phase of ``--device-graph-mode`` may hold, and their checks.

Shared by the flag's parser (:mod:`devgraph.flag.config`), a runner's arguments and
``create_backend(options=...)``, so a key means the same and is refused the same way wherever it arrives.
Each check raises a one-line :class:`~devgraph.errors.ConfigError` naming the field, the shortened value and
what is accepted; the parser prefixes the flag and its value.

Which mode names exist, and which of them compile, is the registry's to say: the checks ask it
(:func:`registered_modes`, :func:`compiling_modes`) when a name or a compiler needs checking.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from devgraph.contract.modes import MODE_NAME_PATTERN, SPECIAL_MODES, Compiler, SpecialMode, Strategy
from devgraph.errors import ConfigError
from devgraph.flag.sizes import HARD_MAX_SIZE, check_size, check_size_list
from devgraph.messages import kind, shorten
from devgraph.registry.plugins import get_registry

__all__ = [
    "COMPILERS",
    "INDUCTOR_MODES",
    "ModeNames",
    "ModeNamesLookup",
    "ON_RECOMPILE",
    "PHASE_KEYS",
    "bad",
    "check_backend_options",
    "check_combination",
    "check_field",
    "check_mode",
    "compiling_modes",
    "did_you_mean",
    "registered_modes",
]

logger = logging.getLogger(__name__)

#: Keys a phase's JSON object may hold.
PHASE_KEYS: tuple[str, ...] = (
    "backend",
    "sizes",
    "max_size",
    "compiler",
    "inductor_mode",
    "on_recompile",
    "cache_dir",
    "warmup_iters",
    "lazy",
    "max_graphs",
    "max_graph_bytes",
    "fallback",
    "axes",
)
COMPILERS: tuple[str, ...] = tuple(c.value for c in Compiler)
#: Inductor modes that leave CUDA graphs to devgraph.
INDUCTOR_MODES: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs")
#: Inductor modes that turn on inductor's own CUDA graphs (``triton.cudagraphs``), refused with this reason.
_NESTING_INDUCTOR_MODES: dict[str, str] = {
    "reduce-overhead": "it turns on inductor's own CUDA graphs, which would nest inside devgraph's",
    "max-autotune": "it turns on inductor's own CUDA graphs (triton.cudagraphs), which would nest inside "
    "devgraph's; use max-autotune-no-cudagraphs for the same tuning",
}
ON_RECOMPILE: tuple[str, ...] = ("warn", "raise")
WARMUP_ITERS_MAX = 16
MAX_GRAPHS_MAX = 1 << 20
MAX_GRAPH_BYTES_MAX = (1 << 63) - 1
_CACHE_DIR_MAX_CHARS = 4096

ModeNamesLookup = Callable[[], Iterable[str]]


def registered_modes() -> list[str]:
    """The mode names backends are registered under, on any platform (the registry loads on first use)."""
    return get_registry().backend_names()


def compiling_modes() -> list[str]:
    """The registered mode names whose backend runs the forward through ``torch.compile`` (the strategy
    class's ``accepts_compiler``): where ``compiler`` and ``inductor_mode`` mean something."""
    return get_registry().compiling_names()


class ModeNames:
    """The accepted mode names: those given, else the registered ones; asked for at most once and only when
    a name needs checking."""

    def __init__(self, known: Iterable[str] | ModeNamesLookup | None) -> None:
        self._source: Iterable[str] | ModeNamesLookup = registered_modes if known is None else known
        self._names: list[str] | None = None

    def names(self) -> list[str]:
        if self._names is None:
            source = self._source
            try:
                names = list(source() if callable(source) else source)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # the registry never raises; a caller's lookup might
                logger.warning("devgraph: mode names lookup failed (%s); accepting built-in names", exc)
                names = [s.value for s in Strategy]
            self._names = sorted(set(SPECIAL_MODES) | {n for n in names if isinstance(n, str)})
        return self._names


# -- value checks (messages name the field; parse() prefixes the flag and its value) ---------------------
def _folded(name: str) -> str:
    """A name as compared for hints: case and ``-`` vs ``_`` do not count (``FULL``, ``tc-piecewise``)."""
    return name.casefold().replace("-", "_")


def did_you_mean(value: str, accepted: Iterable[str]) -> str | None:
    """The accepted name ``value`` was most likely meant to be: one that differs only in case or ``-``/``_``,
    else the closest by :mod:`difflib` among the folded names; ``None`` when none is close."""
    by_folded = {_folded(name): name for name in accepted}
    folded = _folded(value)
    if folded in by_folded:
        return by_folded[folded]
    close = difflib.get_close_matches(folded, list(by_folded), n=1)
    return by_folded[close[0]] if close else None


def bad(value: object, what: str, accepted: Iterable[str]) -> ConfigError:
    """The refusal of a name outside a closed set (modes, phases, compilers, keys...): names are exact
    (lower case, as documented), and a near miss gets a ``did you mean`` hint."""
    accepted = list(accepted)
    hint = ""
    if isinstance(value, str) and len(value) <= 64:
        close = did_you_mean(value, accepted)
        hint = f" (did you mean {close!r}?)" if close else ""
    return ConfigError(f"{what} {shorten(value)} is not valid{hint}; accepted: {', '.join(accepted)}")


def check_mode(value: object, what: str, modes: ModeNames | None) -> str:
    if not isinstance(value, str) or not MODE_NAME_PATTERN.fullmatch(value):
        accepted = modes.names() if modes is not None else [*SPECIAL_MODES, *(s.value for s in Strategy)]
        raise bad(value, what, accepted)
    if modes is not None and value not in modes.names():
        raise bad(value, what, modes.names())
    return value


def _check_choice(value: object, what: str, accepted: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in accepted:
        raise bad(value, what, accepted)
    return value


def _check_int(value: object, what: str, low: int, high: int, python: bool) -> int:
    wanted = f"an int in [{low}, {high}]" if python else f"an integer from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be {wanted}, got {shorten(value)} ({kind(value)})")
    if not low <= value <= high:
        raise ConfigError(f"{what} must be {wanted}, got {shorten(value)}")
    return value


def _check_bool(value: object, what: str, python: bool) -> bool:
    if not isinstance(value, bool):
        wanted = "True or False" if python else "true or false"
        raise ConfigError(f"{what} must be {wanted}, got {shorten(value)} ({kind(value)})")
    return value


def _check_inductor_mode(value: object, what: str) -> str:
    if isinstance(value, str) and value in _NESTING_INDUCTOR_MODES:
        raise ConfigError(
            f"{what} {value!r} is refused: {_NESTING_INDUCTOR_MODES[value]}; "
            f"accepted: {', '.join(INDUCTOR_MODES)}"
        )
    return _check_choice(value, what, INDUCTOR_MODES)


def _check_cache_dir(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or "\0" in value or len(value) > _CACHE_DIR_MAX_CHARS:
        raise ConfigError(
            f"{what} must be a directory path (a non-empty string of at most {_CACHE_DIR_MAX_CHARS} "
            f"characters), got {shorten(value)}"
        )
    return value


def _size_phase(phase: str | None) -> str:
    """The phase whose hard cap applies; without a phase (a bare PhaseConfig) the largest cap."""
    if phase is not None:
        return phase
    return max(HARD_MAX_SIZE, key=lambda p: HARD_MAX_SIZE[p])


def _check_fallback(value: object, what: str, modes: ModeNames | None) -> str:
    """A fallback is a mode that captures graphs: not ``auto`` (ambiguous), nor one that runs eagerly
    (steps the primary declines already run eagerly without a fallback)."""
    name = check_mode(value, what, modes)
    if name in SPECIAL_MODES or name == Strategy.EAGER.value:
        captured = [s.value for s in Strategy if s is not Strategy.EAGER]
        raise ConfigError(
            f"{what} {name!r} captures no graphs; a fallback is a graph mode such as {', '.join(captured)} "
            "(steps no graph set takes run eagerly anyway)"
        )
    return name


def _check_axes(value: object, what: str, phase: str | None) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``{"requests": [1, 2, 4]}``: buckets of axes other than tokens, as sorted pairs (the form a
    PhaseConfig holds, which this also accepts)."""
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            f"{what} must be an object mapping an axis other than tokens to its sizes, e.g. "
            f'{{"requests": [1, 4, 16]}}; got {shorten(value)}'
        )
    pairs = []
    for axis, sizes in value.items():
        if not isinstance(axis, str) or not axis.isidentifier() or axis == "tokens":
            raise ConfigError(
                f"{what} keys are axis names other than 'tokens' (whose sizes are 'sizes'), "
                f"got {shorten(axis)}"
            )
        pairs.append((axis, tuple(sorted(set(check_size_list(_size_phase(phase), sizes, f"{what}.{axis}"))))))
    return tuple(sorted(pairs))


def check_field(
    key: str, value: Any, what: str, phase: str | None, modes: ModeNames | None, *, python: bool = False
) -> Any:
    """One phase key, checked and normalized (``sizes`` becomes a tuple, in the order given).

    The same check for the flag's JSON and for a runner's argument; ``python`` words the refusal the way
    Python spells it (``an int in [0, 16]``, ``True or False``) rather than JSON (``an integer from 0 to
    16``, ``true or false``)."""
    if key == "backend":
        return check_mode(value, what, modes)
    if key == "sizes":
        return tuple(check_size_list(_size_phase(phase), value, what))
    if key == "max_size":
        return check_size(_size_phase(phase), value, what)
    if key == "compiler":
        return _check_choice(value, what, COMPILERS)
    if key == "inductor_mode":
        return _check_inductor_mode(value, what)
    if key == "on_recompile":
        return _check_choice(value, what, ON_RECOMPILE)
    if key == "cache_dir":
        return _check_cache_dir(value, what)
    if key == "warmup_iters":
        return _check_int(value, what, 0, WARMUP_ITERS_MAX, python)
    if key == "lazy":
        return _check_bool(value, what, python)
    if key == "max_graphs":
        return _check_int(value, what, 1, MAX_GRAPHS_MAX, python)
    if key == "max_graph_bytes":
        return _check_int(value, what, 0, MAX_GRAPH_BYTES_MAX, python)
    if key == "fallback":
        return _check_fallback(value, what, modes)
    if key == "axes":
        return _check_axes(value, what, phase)
    raise bad(key, "key", PHASE_KEYS)


def compiler_ignored(
    backend: str,
    prefix: str,
    key: str,
    value: object,
    resolved_from: str = "",
    compiling: Iterable[str] | None = None,
) -> ConfigError:
    """The error for ``compiler`` / ``inductor_mode`` on a backend that does not compile; ``compiling`` names
    the modes that do (by default the registry's)."""
    how = (
        f"mode {resolved_from!r} resolves to backend {backend!r}, which"
        if resolved_from
        else f"backend {backend!r}"
    )
    return ConfigError(
        f"{prefix}{key} {shorten(value)} would be ignored: {how} does not compile; compiler and "
        f"inductor_mode apply to backends {', '.join(compiling_modes() if compiling is None else compiling)} "
        "(and auto where it resolves to one)"
    )


def check_combination(values: Mapping[str, Any], prefix: str) -> None:
    """Rules between the keys of one phase; ``prefix`` is ``"decode."`` or ``""``."""
    backend = values.get("backend") or SpecialMode.AUTO.value
    compiling = [key for key in ("compiler", "inductor_mode") if values.get(key) is not None]
    if compiling and backend != SpecialMode.AUTO.value and backend not in compiling_modes():
        raise compiler_ignored(backend, prefix, compiling[0], values[compiling[0]])
    inductor_mode, compiler = values.get("inductor_mode"), values.get("compiler")
    if inductor_mode is not None and compiler != Compiler.INDUCTOR.value:
        raise ConfigError(
            f'{prefix}inductor_mode {inductor_mode!r} needs {prefix}compiler "inductor" '
            f"(got {shorten(compiler)}); add it or drop inductor_mode"
        )
    fallback = values.get("fallback")
    if fallback is not None:
        if fallback == backend:
            raise ConfigError(
                f"{prefix}fallback {fallback!r} is the phase's own mode; name another graph mode"
            )
        if backend in (SpecialMode.DISABLED.value, Strategy.EAGER.value):
            raise ConfigError(
                f"{prefix}fallback {fallback!r} backs a mode that captures graphs; "
                f"{prefix}backend is {backend!r}"
            )
        if values.get("lazy"):
            raise ConfigError(
                f"{prefix}fallback is captured at start-up, but {prefix}lazy captures each key on first "
                "sight; "
                "drop one of them"
            )
    if values.get("lazy") is False:
        for key in ("max_graphs", "max_graph_bytes"):
            if values.get(key) is not None:
                raise ConfigError(
                    f"{prefix}{key} bounds the lazily captured graph cache, but {prefix}lazy is false; "
                    f"drop {key} or set lazy to true"
                )


def check_backend_options(
    options: Mapping[str, Any], *, backend: str | None = None, compiles: bool = True
) -> dict[str, Any]:
    """Check the keys :class:`~devgraph.contract.backend.BackendOptions` types (``compiler``,
    ``inductor_mode``, ``on_recompile``, ``cache_dir``) and return them; other keys are left for the backend
    (``extra``).

    With ``backend`` (a concrete backend name) whose class does not compile (``compiles=False``),
    ``compiler`` / ``inductor_mode`` is an error, as in the flag.
    """
    checked: dict[str, Any] = {}
    for key in ("compiler", "inductor_mode", "on_recompile", "cache_dir"):
        value = options.get(key)
        if value is not None:
            checked[key] = check_field(key, value, f"backend option {key}", None, None)
    if backend is not None and not compiles:
        for key in ("compiler", "inductor_mode"):
            if key in checked:
                raise compiler_ignored(backend, "backend option ", key, checked[key])
    if "inductor_mode" in checked and checked.get("compiler") != Compiler.INDUCTOR.value:
        raise ConfigError(
            f'backend option inductor_mode {checked["inductor_mode"]!r} needs compiler "inductor"'
        )
    return checked
