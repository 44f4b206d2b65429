"""Entry point ``example`` in group ``devgraph``: registers ``cpu:example_full``.

devgraph loads this module lazily (on the first question asked of its registry) and calls the hooks
below with a ``register`` callback. Keep imports of heavy or optional dependencies inside the hooks or
behind the platform's ``availability()``: a plug-in that fails to import is reported by ``devgraph
info`` and skipped, but it should not need to fail at all on a machine without its hardware.
"""

from __future__ import annotations

from collections.abc import Callable

from devgraph import hookimpl


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph_example_plugin.backend import ExampleFullBackend

    register(ExampleFullBackend, name="example_full", platform="cpu", phases=("decode",))
