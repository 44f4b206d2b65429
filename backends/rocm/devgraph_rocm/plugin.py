"""Entry point ``rocm`` in group ``devgraph``: the ROCm platform, its HIP graph backends and its policy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph import hookimpl


@hookimpl
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    from devgraph_rocm.platform import RocmPlatform

    register(RocmPlatform)


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph_rocm.backends import RocmBreakableBackend, RocmFullGraphBackend, RocmTcPiecewiseBackend

    register(RocmFullGraphBackend, name="full", platform="rocm", default_for=("decode",))
    register(RocmTcPiecewiseBackend, name="tc_piecewise", platform="rocm", default_for=("prefill", "encode"))
    register(RocmBreakableBackend, name="breakable", platform="rocm")


@hookimpl
def devgraph_compatibility_rules(register: Callable[[Any], None]) -> None:
    from devgraph_rocm.rules import ROCM_RULES

    for rule in ROCM_RULES:
        register(rule)
