"""``register_backend``: registering a backend class directly, as a call or as a class decorator."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from devgraph.contract.backend import DeviceGraphBackend
from devgraph.contract.phases import PHASES
from devgraph.registry.plugins import get_registry

__all__ = ["register_backend"]

B = TypeVar("B", bound=type[DeviceGraphBackend])


@overload
def register_backend(
    cls: B,
    /,
    *,
    name: str | None = ...,
    platform: str,
    phases: Iterable[str] = ...,
    default_for: Iterable[str] = ...,
) -> B: ...


@overload
def register_backend(
    cls: None = None,
    /,
    *,
    name: str | None = ...,
    platform: str,
    phases: Iterable[str] = ...,
    default_for: Iterable[str] = ...,
) -> Callable[[B], B]: ...


def register_backend(
    cls: B | None = None,
    /,
    *,
    name: str | None = None,
    platform: str,
    phases: Iterable[str] = PHASES,
    default_for: Iterable[str] = (),
) -> Any:
    """Register a backend directly, as a call or as a class decorator.

    ``register_backend(MyBackend, name="full", platform="mychip")`` or::

        @devgraph.register_backend(platform="mychip", phases=("decode",), default_for=("decode",))
        class MyBackend(FullGraphBackend): ...

    Plug-ins load first, so a clash with an installed plug-in is reported here, naming both origins.
    """

    def apply(target: B) -> B:
        origin = f"register_backend() in {getattr(target, '__module__', '?')}"
        get_registry().add_backend(
            target, name=name, platform=platform, phases=phases, default_for=default_for, origin=origin
        )
        return target

    return apply(cls) if cls is not None else apply
