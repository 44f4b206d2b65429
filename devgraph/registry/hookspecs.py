"""Hook specifications for devgraph plug-ins.

A plug-in is a module (named by an entry point in group ``devgraph``) that implements some of these
hooks with ``@devgraph.hookimpl``. Each hook receives a ``register`` callback; call it once per thing
you provide::

    import devgraph

    @devgraph.hookimpl
    def devgraph_register_backends(register):
        register(MyBackend, name="full", platform="mychip", phases=("decode",), default_for=("decode",))

A plug-in loads as a unit: if ``register`` rejects something (a flag-unsafe or reserved name, an abstract
class, a clash) and the plug-in lets the error escape, or a hook raises anything (``SystemExit`` included),
everything the plug-in registered is rolled back and ``devgraph info`` shows it as failed with the reason.
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
    """Register :class:`~devgraph.contract.platform.GraphPlatform` subclasses: ``register(PlatformClass)``.

    The class must be complete (no abstract method left) and set ``name`` and ``device_type``;
    ``availability()`` must return a :class:`~devgraph.contract.platform.Availability` (anything else, or
    raising, makes the platform unusable with that reason).
    """


@hookspec
def devgraph_register_backends(register: Callable[..., None]) -> None:
    """Register backends: ``register(cls, name=, platform=, phases=(...), default_for=(...))``.

    ``name`` is the mode name users type: lowercase letters, digits and ``_`` (``MODE_NAME_PATTERN``),
    not ``auto``, ``disabled`` or ``eager``; ``default_for`` lists the phases for which ``auto`` picks it.
    The class must be a complete :class:`~devgraph.contract.backend.DeviceGraphBackend` (no abstract method
    left).
    """


@hookspec
def devgraph_compatibility_rules(register: Callable[[Any], None]) -> None:
    """Register :class:`~devgraph.registry.rules.CompatibilityRule` objects that downgrade a phase's backend.

    A rule's ``when(features)`` sees the engine's features plus ``platform`` and ``phase``. A predicate
    that raises is skipped for that decision (the backend stays), logged, and shown by ``devgraph info``
    against the plug-in. Vendor policy belongs here (the ROCm plug-in registers ``rocm-no-breakable``).
    """
