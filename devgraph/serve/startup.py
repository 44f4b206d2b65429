"""Start-up of ``devgraph serve``, stage by stage: the model source, the limits, the KV cache, the weights,
the graphs, the warm-up.

Each stage is a function of its own and is timed (``Startup.times``, reported by ``/v1/engine/stats`` and
logged at INFO), so a log shows where start-up is and where its seconds went:

1. :func:`open_source`: ``--model`` (a preset or a checkpoint directory: config, tokenizer and
   generation config read, refused with every reason when the checkpoint is not servable);
2. the model's config with the command-line arguments applied, then the KV cache checked against free
   memory (less the weights still to load) and against the warm-up, before anything is allocated;
3. the weights: drawn (preset) or loaded tensor by tensor (checkpoint);
4. the graphs: the engine's runners capture (``Engine(capture=True)``);
5. the warm-up requests (in ``server.py``, which then listens).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from devgraph import ConfigError, DeviceGraphConfig, resolve_platform
from devgraph.flag.factory import resolve_mode, usable_platform
from devgraph.messages import shorten
from devgraph.reference.config import ReferenceConfig
from devgraph.reference.kernels.backends import auto_fallback_note
from devgraph.serve.checkpoint.source import ModelSource, open_model
from devgraph.serve.checkpoint.template_render import RenderLimits
from devgraph.serve.engine.config import EngineConfig, SchedulerMode
from devgraph.serve.engine.engine import Engine
from devgraph.serve.engine.sizing import KvSizing, kv_blocks_for_memory
from devgraph.serve.engine.warmup import check_warm_up_fits

__all__ = [
    "Startup",
    "build_engine",
    "capture_plan",
    "check_kv_memory",
    "device_defaults",
    "kv_cache_bytes",
    "open_source",
    "weight_bytes",
]

logger = logging.getLogger(__name__)

#: The KV cache may take at most this share of the device's free memory (weights and steps need the rest).
KV_MEMORY_SHARE = 0.9
GiB = float(1 << 30)
MiB = float(1 << 20)


@dataclass
class Startup:
    """Seconds per start-up stage (``model_read_s``, ``weights_s``, ``graphs_s``, ``warm_up_s``) and what
    the weights were."""

    times: dict[str, float] = field(default_factory=dict)
    weights: str = ""
    kv_sizing: dict[str, Any] | None = None  # --gpu-memory-utilization: how the KV cache was sized

    def report(self) -> dict[str, Any]:
        out = {**{k: round(v, 3) for k, v in self.times.items()}, "weights": self.weights}
        return out if self.kv_sizing is None else {**out, "kv_sizing": self.kv_sizing}


def device_defaults(device: torch.device) -> dict[str, Any]:
    """Defaults that depend on the device: a small model and batch on the CPU, Qwen3-0.6B's shape on a GPU."""
    if device.type == "cpu":
        return {"preset": "tiny", "max_running_requests": 8, "token_budget": 64}
    return {"preset": "qwen3-0.6b", "max_running_requests": 32, "token_budget": 2048}


def _device(args: argparse.Namespace) -> torch.device:
    # The demo's check: `--device cuda` on a CPU-only torch is one line saying why, not an AssertionError.
    platform = usable_platform(args.device)
    return torch.device(args.device) if args.device else platform.default_device()


def _model_value(args: argparse.Namespace, device: torch.device) -> str:
    model, preset = getattr(args, "model", None), getattr(args, "preset", None)
    if model is not None and preset is not None:
        raise ConfigError(f"give --model or --preset, not both (--model {model} --preset {preset})")
    return model or preset or device_defaults(device)["preset"]


def open_source(args: argparse.Namespace, startup: Startup | None = None) -> ModelSource:
    """The model ``--model`` (or ``--preset``) names, read but not built; timed as ``model_read_s``."""
    start = time.perf_counter()
    template = getattr(args, "chat_template", None)
    source = open_model(
        _model_value(args, _device(args)),
        Path(template) if template else None,
        trust_request_template=getattr(args, "trust_request_chat_template", False),
        render_limits=RenderLimits(seconds=getattr(args, "chat_template_timeout", RenderLimits.seconds)),
    )
    if startup is not None:
        startup.times["model_read_s"] = time.perf_counter() - start
    return source


def _batch_limits(
    args: argparse.Namespace, defaults: dict[str, Any], device: torch.device
) -> tuple[int, int]:
    """``--max-running-requests`` and ``--token-budget`` (defaults filled in); :class:`ConfigError` naming
    the arguments, and the values that work, when a step could not hold every running request."""
    running = args.max_running_requests or defaults["max_running_requests"]
    budget = args.token_budget or max(defaults["token_budget"], running)
    if budget < running:
        given = "" if args.max_running_requests else f", the default on {device.type}"
        raise ConfigError(
            f"--token-budget {budget} is below --max-running-requests {running}{given}: every running "
            f"request must fit one step; give --token-budget {running} or more, or --max-running-requests "
            f"{budget} or less"
        )
    return running, budget


def build_engine(
    args: argparse.Namespace,
    source: ModelSource | None = None,
    startup: Startup | None = None,
    *,
    group: Any = None,
    engine_class: Callable[..., Engine] = Engine,
) -> Engine:
    """The model and engine the arguments describe, graphs captured. Logs each start-up stage (model and KV
    cache, the weights, each graph captured, the capture table) at INFO, so a log shows where start-up
    is; ``startup`` (if given) gets each stage's seconds. ``group``: a tensor-parallel process group (the
    model is this rank's shard; ``engine_class`` builds rank 0's engine)."""
    startup = startup if startup is not None else Startup()
    device = _device(args)
    defaults = device_defaults(device)
    running, budget = _batch_limits(args, defaults, device)
    source = source if source is not None else open_source(args, startup)
    overrides: dict[str, Any] = {"max_requests": running}
    for name in ("dtype", "num_blocks", "max_seq_len", "attention"):
        overrides[name] = getattr(args, name, None)
    utilization = getattr(args, "gpu_memory_utilization", None)
    if utilization is not None:
        if args.num_blocks is not None:
            raise ConfigError(
                "--gpu-memory-utilization sizes the KV cache from free memory; --num-blocks sets it: give one"
            )
        # A stand-in cache of one request of the full context until the graphs' memory is estimated.
        full = source.model_config(overrides).max_blocks_per_request
        overrides["num_blocks"] = 1 + full
    model_config = source.model_config(overrides)
    # Before allocating (or capturing) anything: the cache must fit the memory and the warm-up.
    # Under tensor parallelism each rank holds about 1/N of the weights and of the KV cache (its heads).
    shards = torch.distributed.get_world_size(group) if group is not None else 1
    loading = 0 if source.is_preset else weight_bytes(model_config) // shards
    check_kv_memory(model_config, _free_bytes(device), device, loading, shards)
    check_warm_up_fits(model_config)
    _warn_small_cache(model_config)
    engine_config = EngineConfig(
        max_running_requests=running,
        token_budget=budget,
        mixed_steps=not args.no_mixed_steps,
        deterministic=args.deterministic,
        scheduler=SchedulerMode.parse(getattr(args, "scheduler", "overlap")),
    )
    logger.info(
        "building the model: %s (%s, %d layers, context %d) on %s; KV cache %.1f MiB (%d blocks of %d "
        "positions)",
        source.describe(),
        str(model_config.dtype).removeprefix("torch."),
        model_config.num_layers,
        model_config.max_seq_len,
        device,
        kv_cache_bytes(model_config) / MiB,
        model_config.total_blocks,
        model_config.block_size,
    )
    note = auto_fallback_note(model_config.kernels, device)
    if note:
        logger.warning("%s", note)
    built = source.build(model_config, device, args.seed, getattr(args, "progress", None), group)
    startup.times["weights_s"] = built.seconds
    startup.weights = built.how
    logger.info(
        "model ready in %.1f s: weights %.1f MiB, %s", built.seconds, built.weight_bytes / MiB, built.how
    )
    mode = args.device_graph_mode
    graphs = mode if isinstance(mode, DeviceGraphConfig) else DeviceGraphConfig.parse(mode or "auto")
    background, why = capture_plan(
        getattr(args, "capture_in_background", False), graphs, shards, resolve_platform(device).name
    )
    logger.info(
        "%s graphs (--device-graph-mode %s): %s",
        "serving before the" if background else "capturing",
        graphs.source,
        why,
    )
    start = time.perf_counter()
    engine = engine_class(
        built.model,
        engine_config,
        device_graph_mode=graphs,
        progress=args.progress,
        capture=not background and utilization is None,
    )
    if utilization is not None:
        size_kv_cache(engine, utilization, startup)
        if not background:
            engine.capture()
    if background:
        capture = engine.capture_in_background()
        logger.info("%d graphs to capture in the background, one key between two steps", capture.total)
    startup.times["graphs_s"] = time.perf_counter() - start
    logger.info("graphs %s in %.1f s", "set up" if background else "ready", startup.times["graphs_s"])
    logger.info(
        "scheduler: %s (--scheduler; %s)",
        engine_config.scheduler,
        "the next step is issued while the device runs this one"
        if engine_config.scheduler.overlaps
        else "each step is read before the next is scheduled",
    )
    _log_added_sizes(engine, graphs)
    return engine


def capture_plan(
    asked: bool | None, graphs: DeviceGraphConfig, ranks: int = 1, platform: str | None = None
) -> tuple[bool, str]:
    """Whether the graphs are captured in the background (the engine answers from the moment the weights
    are loaded, running eagerly until each step's key is captured) or all of them before the server
    listens, and why, for the log. ``asked``: ``--capture-in-background`` (``True``),
    ``--no-capture-in-background`` (``False``) or neither (``None``: in the background where that is safe
    and pays). ``platform``: the platform's name, so that ``auto`` is judged by the backend it resolves to
    there (ROCm's prefill is ``tc_piecewise``, which compiles); ``None`` judges the flag as written.

    Up front by default where the background would not pay or not be safe: with several ranks (each rank
    must capture the same key between the same two steps), where a phase compiles (a key's compile takes
    seconds, and a request arriving during it waits for all of them: a first response sooner but a slow
    one, and compiled code the first steps never ran), where no phase has graphs or every phase with graphs
    captures lazily (nothing to capture before the first steps). A phase with a ``fallback`` graph set
    cannot be captured key by key: the default captures it up front and ``--capture-in-background`` is
    refused with a :class:`ConfigError` saying so."""
    phases = {name: graphs.for_phase(name) for name in ("decode", "prefill")}
    backends = {
        name: phase.backend if platform is None else resolve_mode(platform, name, phase.backend)
        for name, phase in phases.items()
    }
    with_fallback = [name for name, phase in phases.items() if phase.fallback is not None]
    if asked and with_fallback:
        raise ConfigError(
            f"--capture-in-background captures one key at a time, which a phase with a fallback graph set "
            f"cannot ({' and '.join(with_fallback)}: --device-graph-mode {shorten(graphs.source)}); drop "
            "the fallback, or drop --capture-in-background to capture before listening"
        )
    if asked is not None:
        return asked, "--capture-in-background" if asked else "--no-capture-in-background"
    if ranks > 1:
        return False, "every rank captures before serving (the default under tensor parallelism)"
    graphed = [phase for name, phase in phases.items() if backends[name] not in ("disabled", "eager")]
    if not graphed:
        return False, "no phase has graphs"
    compiling = [
        phase
        for name, phase in phases.items()
        if phase.compiler is not None or "tc_piecewise" in (backends[name], phase.fallback)
    ]
    if compiling:
        return False, (
            "captured before serving, the default where a phase compiles (a compile between two steps would "
            "hold every request that arrives meanwhile); --capture-in-background serves before them anyway"
        )
    if with_fallback:
        return False, (
            f"captured before serving, the default where a phase has a fallback graph set "
            f"({' and '.join(with_fallback)}: its keys cannot be captured one at a time)"
        )
    if all(phase.lazy for phase in graphed):
        return False, "each key is captured on first sight (lazy), so there is nothing to capture before"
    return True, (
        "captured between steps while the server answers (the default; --no-capture-in-background "
        "captures them all before listening)"
    )


#: The command-line argument that sets each phase's largest step (the size its runner always captures).
_LARGEST_STEP = {"decode": "--max-running-requests", "prefill": "--token-budget"}


def _log_added_sizes(engine: Engine, graphs: DeviceGraphConfig) -> None:
    """Say which sizes the runners capture beyond the flag's own (``--tuned``, or ``sizes`` in
    ``--device-graph-mode``): the engine's largest step always gets a graph, so no step of the engine's
    own size runs eagerly; that is one graph more than the file asked for, and is said, not silent."""
    for phase, runner in (("decode", engine.decode_runner), ("prefill", engine.prefill_runner)):
        asked = graphs.for_phase(phase).sizes
        if asked is None:
            continue
        captured = list(runner.schedule.token_sizes)
        added = sorted(set(captured) - set(asked))
        if added:
            logger.info(
                "%s graphs: %s besides the sizes asked for (%s): the engine's largest %s step (%s %d) always "
                "gets a graph; capturing %s",
                phase,
                added,
                list(asked),
                phase,
                _LARGEST_STEP[phase],
                max(captured),
                captured,
            )


def memory_info(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` (the host's memory for the CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    free, total = resolve_platform(device).mem_get_info()
    return int(free), int(total)


def size_kv_cache(engine: Engine, utilization: float, startup: Startup) -> KvSizing:
    """``--gpu-memory-utilization``: estimate both runners' graph memory (before capture), then allocate
    the KV cache with what is left of ``utilization`` of the device's memory, but never more blocks than the
    running requests can fill (``1 + --max-running-requests x`` the blocks of a full context: the engine has
    no prefix cache, so a block past those is never written). On the CPU the memory is the host's RAM: a
    0.4 MiB model would otherwise get gigabytes of cache; the log line says which memory it was."""
    start = time.perf_counter()
    estimates = [r.estimate_graph_memory() for r in (engine.decode_runner, engine.prefill_runner)]
    graph_bytes = sum(e.total_bytes for e in estimates)
    config = engine.model_config
    device = engine.model.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    free, total = memory_info(device)
    stand_in = kv_cache_bytes(config)
    sizing = kv_blocks_for_memory(
        utilization=utilization,
        free_bytes=free,
        total_bytes=total,
        stand_in_bytes=stand_in,
        graph_bytes=graph_bytes,
        block_bytes=stand_in // config.total_blocks,
        min_blocks=config.total_blocks,
    )
    affordable = sizing.num_blocks
    fillable = 1 + engine.config.max_running_requests * config.max_blocks_per_request
    sizing = dataclasses.replace(sizing, num_blocks=min(affordable, fillable))
    engine.resize_kv_cache(sizing.num_blocks)
    startup.times["graph_estimate_s"] = time.perf_counter() - start
    memory = (
        "the host's RAM (the CPU has no memory of its own)" if device.type == "cpu" else f"{device}'s memory"
    )
    startup.kv_sizing = {
        "utilization": utilization,
        "memory": "host" if device.type == "cpu" else "device",
        "graph_bytes_estimated": graph_bytes,
        "kv_cache_bytes": sizing.kv_cache_bytes,
        "num_blocks": sizing.num_blocks,
        "num_blocks_affordable": affordable,
    }
    logger.info(
        "KV cache sized for --gpu-memory-utilization %g of %s: %d blocks, %.1f MiB (graphs estimated at "
        "%.1f MiB before capture, %.1f MiB in use, %.1f MiB total) in %.1f s",
        utilization,
        memory,
        sizing.num_blocks,
        sizing.kv_cache_bytes / MiB,
        graph_bytes / MiB,
        (total - free - stand_in) / MiB,
        total / MiB,
        startup.times["graph_estimate_s"],
    )
    if fillable < affordable:
        logger.info(
            "the share affords %d blocks (%.1f MiB); %d hold every running request at full context "
            "(--max-running-requests %d x %d tokens), so only those are allocated and the rest stays free",
            affordable,
            affordable * sizing.block_bytes / MiB,
            fillable,
            engine.config.max_running_requests,
            config.max_seq_len,
        )
    return sizing


def kv_cache_bytes(config: ReferenceConfig) -> int:
    """Bytes of the paged K and V caches of every layer."""
    per_block = config.block_size * config.num_kv_heads * config.head_dim * config.dtype.itemsize
    return 2 * config.num_layers * config.total_blocks * per_block


def weight_bytes(config: ReferenceConfig) -> int:
    """Bytes of the model's weights (embedding, layers, final norm, an untied LM head)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    layer += 2 * c.hidden_size + (q + 2 * kv if c.qkv_bias else 0)
    layer += (c.num_heads + c.num_kv_heads) * c.head_dim if c.qk_norm else 0
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
    return (embeddings + c.num_layers * layer + c.hidden_size) * c.dtype.itemsize


def check_kv_memory(
    config: ReferenceConfig,
    free_bytes: int | None,
    device: Any = "the device",
    loading: int = 0,
    shards: int = 1,
) -> None:
    """:class:`ConfigError` (one line: the size and the arguments that lower it) when the KV cache would take
    more than :data:`KV_MEMORY_SHARE` of ``free_bytes`` less ``loading`` (weights still to load); nothing
    when the free memory is unknown."""
    if free_bytes is None:
        return
    needed = kv_cache_bytes(config) // shards  # a tensor-parallel rank keeps its KV heads only
    available = free_bytes - loading
    if needed <= KV_MEMORY_SHARE * available:
        return
    weights = f" and the weights need {loading / GiB:.1f} GiB of it" if loading else ""
    raise ConfigError(
        f"the KV cache needs {needed / GiB:.1f} GiB ({config.total_blocks} blocks of {config.block_size} "
        f"positions, {config.num_layers} layers, K and V) but {device} has {free_bytes / GiB:.1f} GiB free"
        f"{weights}: lower --max-seq-len, --num-blocks (default: enough for --max-running-requests requests "
        "of --max-seq-len tokens) or --max-running-requests"
    )


def _free_bytes(device: torch.device) -> int | None:
    try:
        if device.type == "cuda" and device.index is not None:  # that GPU, not the current one
            return int(torch.cuda.mem_get_info(device)[0])
        return int(resolve_platform(device).mem_get_info()[0])
    except Exception:  # unknown: the allocation itself will say
        return None


def _warn_small_cache(config: ReferenceConfig) -> None:
    usable = config.total_blocks - 1  # block 0 is scratch
    full = config.max_blocks_per_request
    if usable < full:
        logger.warning(
            "the KV cache holds %d tokens (%d usable blocks of %d), less than one request of the full "
            "context (%d tokens): longer requests get 400; --num-blocks %d or more holds one",
            usable * config.block_size,
            usable,
            config.block_size,
            config.max_seq_len,
            full + 1,
        )
