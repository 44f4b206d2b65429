"""devgraph: hardware-abstracted device-graph capture and replay for PyTorch inference engines.

An engine builds one :class:`GraphRunner` per phase, calls ``capture()`` at start-up and ``run()`` on
every step; ``--device-graph-mode`` (see :func:`add_device_graph_args`) picks the strategy per phase.
"""

from devgraph._version import __version__
from devgraph.backend import BackendOptions, Batch, DeviceGraphBackend
from devgraph.breaks import BreakOp, graph_break
from devgraph.capture import CaptureReport, KeyReport
from devgraph.config import DeviceGraphConfig, PhaseConfig, add_device_graph_args
from devgraph.context import forward_context, get_forward_context, is_capturing, is_replaying
from devgraph.dispatch import EagerReason
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
from devgraph.inputs import StaticInput
from devgraph.keys import REQUESTS, TOKENS, GraphKey
from devgraph.modes import Compiler, SpecialMode, Strategy
from devgraph.phases import PHASES, Phase
from devgraph.platform import Availability, DeviceGraph, GraphPlatform
from devgraph.plugins import get_registry
from devgraph.register import register_backend
from devgraph.rules import CompatibilityRule
from devgraph.runner import GraphRunner
from devgraph.sizes import DEFAULT_DECODE_SIZES, DEFAULT_PREFILL_SIZES, SizeSchedule, resolve_sizes
from devgraph.state import StateHooks
from devgraph.verify import VerifyResult

__all__ = [
    "Availability",
    "BackendOptions",
    "BackendUnavailableError",
    "Batch",
    "BreakOp",
    "CaptureError",
    "CaptureReport",
    "CompatibilityRule",
    "Compiler",
    "ConfigError",
    "DEFAULT_DECODE_SIZES",
    "DEFAULT_PREFILL_SIZES",
    "DevGraphError",
    "DeviceGraph",
    "DeviceGraphBackend",
    "DeviceGraphConfig",
    "EagerReason",
    "GraphKey",
    "GraphPlatform",
    "GraphRunner",
    "InputError",
    "KeyReport",
    "PHASES",
    "Phase",
    "PhaseConfig",
    "REQUESTS",
    "RecompileError",
    "RegistrationError",
    "ReplayError",
    "SizeSchedule",
    "SpecialMode",
    "StateHooks",
    "StaticInput",
    "Strategy",
    "TOKENS",
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
    "register_backend",
    "resolve_platform",
    "resolve_sizes",
    "__version__",
]
