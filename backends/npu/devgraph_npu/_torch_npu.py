"""The vendor seam: the only module of devgraph-npu that touches ``torch_npu``.

``torch_npu`` is imported lazily, on the first call that needs it, never at plug-in load: ``devgraph
info`` on a machine without it (or without the CANN toolkit under it) must work and say why the NPU is
unusable. Every other module of the plug-in goes through the functions here, so the seam is also
where tests substitute a fake ``torch_npu`` (see ``tests/fakes_npu.py``).

The graph API used (torch-npu 2.x, the same one vllm-ascend and SGLang's NPU runner use):

* ``torch.npu.NPUGraph()``, ``torch.npu.graph_pool_handle()``;
* ``torch.npu.graph(graph, pool=, stream=, auto_dispatch_capture=True, capture_error_mode=)`` entered
  and exited by hand, so a capture can begin and end in different calls (``capture_begin`` /
  ``capture_end`` of :class:`~devgraph.contract.platform.GraphPlatform`);
* ``NPUGraph.update(cpu_update_input=[{kwarg: value}])``: re-issues the captured attention ops whose
  host-side arguments (``actual_seq_lengths_kv``, ``actual_seq_kvlen``, ``context_lens``) change per
  step. torch-npu records those ops during a capture with ``auto_dispatch_capture=True``; one dict in
  the list applies to every recorded op, a key an op was not called with is ignored;
* streams (``Stream``, ``current_stream``, ``stream``, ``synchronize``) and memory (``mem_get_info``,
  ``memory_reserved``, ``empty_cache``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import threading
from types import ModuleType
from typing import Any

from devgraph import Availability, BackendUnavailableError

__all__ = [
    "TorchNpuUnavailable",
    "MODULE",
    "NOT_INSTALLED",
    "installed",
    "load",
    "probe",
    "npu",
    "reset",
]

MODULE = "torch_npu"

NOT_INSTALLED = (
    "torch-npu is not installed: on an Ascend machine with the CANN toolkit, pip install "
    "'devgraph-npu[ascend]' (torch-npu must match the installed torch and CANN versions)"
)

_ENV_HINT = (
    "torch-npu needs the Ascend CANN toolkit: install the CANN version your torch-npu release names and run "
    "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` (it sets LD_LIBRARY_PATH and ASCEND_HOME_PATH) "
    "before starting Python. If importing torch itself fails because torch auto-loads an installed torch-npu "
    "whose CANN libraries are missing, set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to stop the auto-load"
)


class TorchNpuUnavailable(BackendUnavailableError):
    """``torch_npu`` cannot be imported here; the message says what to install or set."""


_lock = threading.Lock()
_module: ModuleType | None = None


def installed() -> bool:
    """Whether a ``torch_npu`` module can be found (without importing it)."""
    try:
        return importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):  # a broken or half-installed package
        return False


def import_failed_message(exc: BaseException) -> str:
    return f"torch_npu failed to import ({type(exc).__name__}: {exc}). {_ENV_HINT}"


def load() -> ModuleType:
    """The ``torch_npu`` module, imported on first use; raises :class:`TorchNpuUnavailable` with advice."""
    global _module
    module = _module
    if module is not None:
        return module
    with _lock:
        if _module is not None:
            return _module
        if not installed():
            raise TorchNpuUnavailable(NOT_INSTALLED)
        try:
            module = importlib.import_module(MODULE)
        except Exception as exc:  # OSError for missing CANN libraries, ImportError for version skew
            raise TorchNpuUnavailable(import_failed_message(exc)) from exc
        _module = module
        return module


def reset() -> None:
    """Forget the imported module (tests swap ``torch_npu`` in and out)."""
    global _module
    with _lock:
        _module = None


def npu() -> Any:
    """The ``torch.npu`` namespace (``torch_npu.npu``)."""
    return load().npu


def probe() -> Availability:
    """Whether NPU graphs can run here and, if not, why; never raises."""
    if not installed():
        return Availability(False, NOT_INSTALLED)
    try:
        module = load()
    except TorchNpuUnavailable as exc:
        return Availability(False, str(exc))
    api = getattr(module, "npu", None)
    try:
        if api is None or not api.is_available():
            return Availability(
                False,
                "torch-npu imported but no Ascend NPU is visible (torch.npu.is_available() is False): check "
                "the driver with `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES",
            )
    except Exception as exc:
        return Availability(
            False, f"torch.npu.is_available() failed ({type(exc).__name__}: {exc}). {_ENV_HINT}"
        )
    if not hasattr(api, "NPUGraph") or not hasattr(api, "graph"):
        return Availability(
            False,
            f"torch-npu {version()} has no torch.npu.NPUGraph: upgrade torch-npu (NPU graphs "
            "need torch-npu 2.1 or newer, host-side updates 2.5 or newer)",
        )
    return Availability(True, f"Ascend NPU graphs via torch-npu {version()}")


def version() -> str:
    return str(getattr(load(), "__version__", "unknown"))


def supports_host_update() -> bool:
    """Whether ``torch.npu.graph`` takes ``auto_dispatch_capture`` (needed for ``NPUGraph.update``)."""
    graph = getattr(npu(), "graph", None)
    if graph is None:
        return False
    try:
        return "auto_dispatch_capture" in inspect.signature(graph).parameters
    except (TypeError, ValueError):
        return False


# -- graphs ------------------------------------------------------------------------------------------
def new_graph() -> Any:
    return npu().NPUGraph()


def graph_pool_handle() -> Any:
    return npu().graph_pool_handle()


def begin_capture(graph: Any, pool: Any, stream: Any, *, auto_dispatch: bool) -> Any:
    """Enter ``torch.npu.graph(...)`` on ``stream``; returns the context to hand to :func:`end_capture`.

    ``capture_error_mode="thread_local"``: other threads of the engine may keep using the device.
    ``auto_dispatch_capture=True`` records the ops whose host-side arguments ``update`` can change.
    """
    kwargs: dict[str, Any] = {"pool": pool, "stream": stream, "capture_error_mode": "thread_local"}
    if auto_dispatch:
        kwargs["auto_dispatch_capture"] = True
    context = npu().graph(graph, **kwargs)
    context.__enter__()
    return context


def end_capture(context: Any) -> None:
    context.__exit__(None, None, None)


def abort_capture(context: Any, graph: Any) -> None:
    """End a capture that failed half-way; swallow the follow-on errors the runtime raises."""
    if context is not None:
        error = RuntimeError("devgraph: capture aborted")
        with contextlib.suppress(Exception):
            context.__exit__(RuntimeError, error, None)
        # If capture_end raised inside __exit__, torch-npu's dispatch mode may still be on the stack.
        _pop_dispatch_mode(getattr(graph, "graph_dispatch_mode", None))
    with contextlib.suppress(Exception):
        graph.reset()
    with contextlib.suppress(Exception):
        npu().synchronize()


def _pop_dispatch_mode(mode: Any) -> None:
    if mode is None:
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    with contextlib.suppress(Exception):
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is mode:
            mode.__exit__(None, None, None)


def update(graph: Any, cpu_update_input: list[dict[str, Any]]) -> None:
    """``graph.update(cpu_update_input=...)``: re-issue the recorded ops with new host-side arguments."""
    graph.update(cpu_update_input=cpu_update_input)


def update_records(graph: Any) -> list[set[str]] | None:
    """The keyword names of each op the capture recorded for update (``None`` where torch-npu does not "
    "say)."""
    mode = getattr(graph, "graph_dispatch_mode", None)
    records = getattr(mode, "graph_dispatch_records", None)
    if records is None:
        return None
    return [set(getattr(r, "kwargs", {}) or {}) for r in records]


# -- streams -----------------------------------------------------------------------------------------
def new_stream() -> Any:
    return npu().Stream()


def current_stream() -> Any:
    return npu().current_stream()


def stream(s: Any) -> contextlib.AbstractContextManager[Any]:
    return npu().stream(s)


def synchronize() -> None:
    npu().synchronize()


def record_event() -> Any:
    """A ``torch.npu.Event`` recorded on the current stream (``query()`` / ``synchronize()``)."""
    event = npu().Event()
    event.record(npu().current_stream())
    return event


# -- memory and device -------------------------------------------------------------------------------
def mem_get_info() -> tuple[int, int]:
    free, total = npu().mem_get_info()
    return int(free), int(total)


def memory_reserved() -> int:
    return int(npu().memory_reserved())


def empty_cache() -> None:
    npu().empty_cache()


def current_device() -> int:
    return int(npu().current_device())


def device_name() -> str:
    return str(npu().get_device_name(current_device()))
