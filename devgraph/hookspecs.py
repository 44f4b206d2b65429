"""Hook specifications for devgraph plug-ins.

A plug-in is a module (named by an entry point in group ``devgraph``) that implements some of these
hooks with ``@devgraph.hookimpl``. Each hook receives a ``register`` callback; call it once per thing
you provide::

    import devgraph

    @devgraph.hookimpl
    def devgraph_register_backends(register):
        register(MyBackend, name="full", platform="mychip", phases=("decode",), default_for=("decode",))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = [
    "hookimpl",
    "hookspec",
    "devgraph_register_platforms",
    "devgraph_register_backends",
    "devgraph_compatibility_rules",
]

hookspec = pluggy.HookspecMarker("devgraph")
hookimpl = pluggy.HookimplMarker("devgraph")


@hookspec
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    """Register :class:`~devgraph.platform.GraphPlatform` subclasses: ``register(PlatformClass)``."""


@hookspec
def devgraph_register_backends(register: Callable[..., None]) -> None:
    """Register backends: ``register(cls, name=, platform=, phases=(...), default_for=(...))``.

    ``name`` is the mode name users type; ``default_for`` lists the phases for which ``auto`` picks it.
    """


@hookspec
def devgraph_compatibility_rules(register: Callable[[Any], None]) -> None:
    """Register :class:`~devgraph.config.CompatibilityRule` objects that downgrade a phase's backend."""
