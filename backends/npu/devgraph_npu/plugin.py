"""Entry point ``npu`` in group ``devgraph``: the Ascend NPU platform and its ``full`` graph backend.

Loading this module imports neither torch_npu nor the CANN libraries; detection happens when
``devgraph info`` or a runner asks the platform for its availability.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devgraph import hookimpl


@hookimpl
def devgraph_register_platforms(register: Callable[[type[Any]], None]) -> None:
    from devgraph_npu.platform import NpuPlatform

    register(NpuPlatform)


@hookimpl
def devgraph_register_backends(register: Callable[..., None]) -> None:
    from devgraph_npu.backends import NpuFullGraphBackend

    # verify steps are decode-shaped (1 + k tokens per request, the same host-side lengths per request), so
    # auto gives verify the decode default (devgraph.contract.phases: verify is like decode).
    register(NpuFullGraphBackend, name="full", platform="npu", phases=("decode", "verify"))
