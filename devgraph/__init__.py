"""devgraph: hardware-abstracted device-graph capture and replay for PyTorch inference engines.

An engine builds one :class:`GraphRunner` per phase, calls ``capture()`` at start-up and ``run()`` on
every step; ``--device-graph-mode`` (see :func:`add_device_graph_args`) picks the strategy per phase.
"""

from devgraph.backend import BackendOptions, Batch, DeviceGraphBackend
from devgraph.breaks import BreakOp, graph_break
from devgraph.config import DeviceGraphConfig, PhaseConfig, add_device_graph_args
from devgraph.context import forward_context, get_forward_context, is_capturing, is_replaying
from devgraph.errors import (
    BackendUnavailableError,
    CaptureError,
    ConfigError,
    DevGraphError,
    InputError,
    RecompileError,
    RegistrationError,
    ReplayError,
)
from devgraph.factory import best_platform, create_backend, resolve_platform
from devgraph.hookspecs import hookimpl
from devgraph.phases import PHASES
from devgraph.platform import Availability, DeviceGraph, GraphPlatform, platform_name_for_device
from devgraph.plugins import get_registry, register_backend
from devgraph.rules import CompatibilityRule
from devgraph.runner import CaptureReport, GraphRunner, StaticInput, VerifyResult
from devgraph.sizes import DEFAULT_DECODE_SIZES, DEFAULT_PREFILL_SIZES, SizeSchedule, resolve_sizes

__version__ = "0.1.0"

__all__ = [
    "Availability",
    "BackendOptions",
    "BackendUnavailableError",
    "Batch",
    "BreakOp",
    "CaptureError",
    "CaptureReport",
    "CompatibilityRule",
    "ConfigError",
    "DEFAULT_DECODE_SIZES",
    "DEFAULT_PREFILL_SIZES",
    "DevGraphError",
    "DeviceGraph",
    "DeviceGraphBackend",
    "DeviceGraphConfig",
    "GraphPlatform",
    "GraphRunner",
    "InputError",
    "PHASES",
    "PhaseConfig",
    "RecompileError",
    "RegistrationError",
    "ReplayError",
    "SizeSchedule",
    "StaticInput",
    "VerifyResult",
    "add_device_graph_args",
    "best_platform",
    "create_backend",
    "forward_context",
    "get_forward_context",
    "get_registry",
    "graph_break",
    "hookimpl",
    "is_capturing",
    "is_replaying",
    "platform_name_for_device",
    "register_backend",
    "resolve_platform",
    "resolve_sizes",
    "__version__",
]
