"""devgraph: hardware-abstracted device-graph capture and replay for PyTorch inference engines.

An engine builds one :class:`GraphRunner` per phase, calls ``capture()`` at start-up and ``run()`` on
every step; ``--device-graph-mode`` (see :func:`add_device_graph_args`) picks the strategy per phase.
"""

from devgraph import _moved
from devgraph._version import __version__
from devgraph.contract.backend import BackendOptions, DeviceGraphBackend
from devgraph.contract.breaks import BreakOp, graph_break
from devgraph.contract.context import forward_context, get_forward_context, is_capturing, is_replaying
from devgraph.contract.inputs import StaticInput
from devgraph.contract.keys import REQUESTS, TOKENS, Batch, GraphKey
from devgraph.contract.modes import Compiler, SpecialMode, Strategy
from devgraph.contract.phases import PHASES, Phase
from devgraph.contract.platform import Availability, DeviceEvent, DeviceGraph, GraphPlatform
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
from devgraph.flag.config import DeviceGraphConfig, PhaseConfig, add_device_graph_args
from devgraph.flag.factory import best_platform, create_backend, resolve_platform
from devgraph.flag.sizes import DEFAULT_DECODE_SIZES, DEFAULT_PREFILL_SIZES, SizeSchedule, resolve_sizes
from devgraph.flag.trace import PhaseSteps, load_steps, write_trace
from devgraph.flag.tuning import apply_tuned, optimal_sizes, tune_phase
from devgraph.registry.hookspecs import hookimpl
from devgraph.registry.plugins import get_registry
from devgraph.registry.register import register_backend
from devgraph.registry.rules import CompatibilityRule
from devgraph.runner.background import BackgroundCapture
from devgraph.runner.capture.job import CaptureReport, KeyReport
from devgraph.runner.dispatch import EagerReason, FallbackReason
from devgraph.runner.graph_runner import GraphRunner
from devgraph.runner.handle import HostCopy, StepHandle
from devgraph.runner.life import LifeState
from devgraph.runner.shared_pool import GraphPool
from devgraph.runner.state import StateHooks
from devgraph.runner.stepping import Agreement
from devgraph.runner.verify import VerifyResult

__all__ = [
    "Agreement",
    "Availability",
    "BackendOptions",
    "BackgroundCapture",
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
    "DeviceEvent",
    "DeviceGraph",
    "DeviceGraphBackend",
    "DeviceGraphConfig",
    "EagerReason",
    "FallbackReason",
    "GraphKey",
    "GraphPlatform",
    "GraphPool",
    "GraphRunner",
    "HostCopy",
    "InputError",
    "KeyReport",
    "LifeState",
    "PHASES",
    "Phase",
    "PhaseConfig",
    "PhaseSteps",
    "REQUESTS",
    "RecompileError",
    "RegistrationError",
    "ReplayError",
    "SizeSchedule",
    "SpecialMode",
    "StateHooks",
    "StaticInput",
    "StepHandle",
    "Strategy",
    "TOKENS",
    "VerifyResult",
    "add_device_graph_args",
    "apply_tuned",
    "best_platform",
    "create_backend",
    "forward_context",
    "get_forward_context",
    "get_registry",
    "graph_break",
    "hookimpl",
    "is_capturing",
    "is_replaying",
    "load_steps",
    "optimal_sizes",
    "register_backend",
    "resolve_platform",
    "resolve_sizes",
    "tune_phase",
    "write_trace",
    "__version__",
]

_moved.install()  # modules renamed inside the package stay importable under their old names, with a warning
