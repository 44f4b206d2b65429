"""One tensor-parallel rank for tests/test_tp.py (and the multi_gpu run), launched torchrun-style.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/tp_worker.py SCENARIOS --out DIR

``SCENARIOS`` is a comma list run in order in one process (names in ``SCENARIOS`` below); each writes its
findings into ``DIR/rank<r>.json`` as soon as it finishes, so a rank that dies leaves what it had. CPU:
gloo over the CPU simulator; ``--device cuda``: NCCL, one GPU per rank (``LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from devgraph import ranks
from devgraph.contract.context import forward_context, is_capturing
from devgraph.contract.keys import Batch, GraphKey
from devgraph.errors import CaptureError, ReplayError
from devgraph.flag.factory import resolve_platform
from devgraph.reference import (
    ReferenceConfig,
    ReferenceModel,
    batch_context,
    make_decode_batch,
    make_prefill_batch,
    reference_inputs,
)
from devgraph.reference.tp import TPReferenceModel, tp_decode_runner, tp_prefill_runner
from devgraph.runner.graph_runner import GraphRunner
from devgraph.runner.life import LifeState
from devgraph.strategies.full import FullGraphBackend

DECODE_SIZES = [1, 2, 4]
PREFILL_SIZES = [8, 16]
FAIL_AT = 2  # the decode key the failure scenarios break (after key 4 was captured)


class Ctx:
    """What every scenario gets: rank, group, device, options, and where findings go."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.cuda = args.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank)))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.modes = args.modes.split(",")
        self.comms = args.comms.split(",")
        self.compiler = args.compiler
        self.out = Path(args.out)
        self.results: dict[str, Any] = {"rank": self.rank, "device": str(self.device)}
        self.group: Any = None
        self.hard_exit = False  # a scenario left a thread stuck in torch: exit without teardown

    def config(self, attention: str) -> ReferenceConfig:
        kernels = "auto" if self.cuda else "torch"
        return ReferenceConfig.preset(
            "tiny", attention=attention, kernels=kernels, max_requests=8, max_seq_len=128
        )

    def model(self, attention: str, comm: str = "auto", group: Any = None) -> TPReferenceModel:
        group = group if group is not None else self.group
        model = TPReferenceModel(self.config(attention), group, device=self.device, seed=0, comm=comm)
        model.randomize_cache(seed=1)
        return model

    def save(self) -> None:
        path = self.out / f"rank{self.rank}.json"
        path.write_text(json.dumps(self.results, indent=1, default=str))


def _error(exc: BaseException, start: float) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}


# -- a fake communicator for capture_hook ---------------------------------------------------------------
class FakeCommunicator:
    """Stands in for a custom all-reduce library: its capture context must be entered around the capture
    session, and it registers every buffer it all-reduces while a graph is being captured."""

    def __init__(
        self, model: TPReferenceModel, platform_capturing: Callable[[], bool], *, watch: bool = True
    ) -> None:
        self.events: list[str] = []
        self.registered: list[int] = []
        self.inside = False
        self._capturing = platform_capturing
        if not watch:  # compiled forwards (tc_piecewise) call no Python at capture: nothing to watch
            return
        comm = model.comm
        original = comm.all_reduce

        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            if self._capturing():
                self.registered.append(tensor.data_ptr())
                if not self.inside:
                    self.events.append("all-reduce captured outside the communicator's context")
            return original(tensor)

        comm.all_reduce = all_reduce  # type: ignore[method-assign]

    @contextmanager
    def capture(self) -> Iterator[None]:
        self.events.append("enter")
        self.inside = True
        try:
            yield
        finally:
            self.inside = False
            self.events.append("exit")

    def on_key(self, key: GraphKey) -> None:
        self.events.append(f"key {key.tokens}")


def _platform_capturing(ctx: Ctx) -> Callable[[], bool]:
    if ctx.cuda:
        return torch.cuda.is_current_stream_capturing
    from devgraph.platforms.sim.graph import is_capturing as sim_capturing

    return sim_capturing


# -- scenarios ------------------------------------------------------------------------------------------
def _steps(ctx: Ctx, runner: GraphRunner, model: TPReferenceModel, phase: str) -> list[dict[str, Any]]:
    """Graph vs eager TP on the same inputs, for steps that pad and steps that fit a key exactly."""
    found = []
    cases: list[Any] = [1, 3, 4] if phase == "decode" else [[3, 5], [2, 4, 6]]
    for i, case in enumerate(cases):
        if phase == "decode":
            batch = make_decode_batch(model, case, seed=10 + i)
        else:
            batch = make_prefill_batch(model, case, prefix_lens=[7] * len(case), seed=20 + i)
        context = batch_context(batch)
        got = runner.run(context=context, copy=True, **batch)
        with forward_context(context), torch.no_grad():
            step = model.decode_step if phase == "decode" else model.prefill_step
            eager = step(**batch)
        check = runner.verify(context=context, **batch)
        found.append(
            {
                "case": case,
                "replayed": check.replayed,
                "graph_vs_eager_same_rows": float((got.float() - eager.float()).abs().max()),
                "graph_vs_eager_padded": check.max_abs_diff,
                "checksum": float(got.double().sum()),  # every rank returns the same full logits
                "scale": check.scale,
            }
        )
    return found


class _Reports(logging.Handler):
    """Counts the capture reports the runner logs (rank 0 only)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += " graphs in " in record.getMessage()


def equivalence(ctx: Ctx) -> dict[str, Any]:
    """Decode and prefill under every mode: replays equal eager TP; the capture hook wraps each capture."""
    out: dict[str, Any] = {}
    reports = _Reports()
    runner_log = logging.getLogger("devgraph.runner")
    runner_log.addHandler(reports)
    runner_log.setLevel(logging.INFO)
    for mode in ctx.modes:
        for comm in ctx.comms:
            for phase in ("decode", "prefill"):
                # full captures paged attention whole; the others cut graphs at the sdpa break op.
                model = ctx.model("paged" if mode == "full" else "sdpa", comm)
                fake = FakeCommunicator(model, _platform_capturing(ctx), watch=mode != "tc_piecewise")
                build = tp_decode_runner if phase == "decode" else tp_prefill_runner
                sizes = DECODE_SIZES if phase == "decode" else PREFILL_SIZES
                start = time.perf_counter()
                runner = build(
                    model,
                    mode=mode,
                    sizes=sizes,
                    check_lockstep=True,
                    capture_hook=fake.capture,
                    capture_context=lambda key, fake=fake: fake.on_key(key),
                )
                runner.capture()
                seconds = time.perf_counter() - start
                out[f"{mode}/{comm}/{phase}"] = {
                    "comm": model.comm.mode,
                    "capture_seconds": seconds,
                    "keys": [str(k) for k in runner.keys],
                    "key_tokens": sorted(k.tokens for k in runner.keys),
                    "hook_events": fake.events,
                    "registered_buffers": len(fake.registered),
                    "steps": _steps(ctx, runner, model, phase),
                    "replays": runner.stats()["replays"],
                }
                runner.close()
    runner_log.removeHandler(reports)
    out["capture_reports_logged"] = reports.count
    out["tp_vs_single_device"] = _tp_vs_single(ctx)
    return out


def _tp_vs_single(ctx: Ctx) -> dict[str, float]:
    """Eager TP over the ranks against the single-device model with the same weights and cache."""
    config = ctx.config("paged")
    single = ReferenceModel(config, device=ctx.device, seed=0)
    single.randomize_cache(seed=1)
    model = TPReferenceModel(config, ctx.group, device=ctx.device, seed=0)
    model.copy_cache_from(single)
    decode = make_decode_batch(single, 4, seed=3)
    prefill = make_prefill_batch(single, [5, 9], prefix_lens=[3, 0], seed=4)
    # comm="torch" (plain torch.distributed calls), eagerly and through dynamo's functional collectives:
    # the path GPUs take; on the CPU it runs outside any graph (docs/tensor-parallel.md says why).
    plain = TPReferenceModel(config, ctx.group, device=ctx.device, seed=0, comm="torch")
    plain.copy_cache_from(single)
    compiled = torch.compile(plain.decode_step, backend="eager", dynamic=False)
    with torch.no_grad():
        expected = single.decode_step(**decode)
        d = (model.decode_step(**decode) - expected).abs().max()
        p = (model.prefill_step(**prefill) - single.prefill_step(**prefill)).abs().max()
        torch_eager = (plain.decode_step(**decode) - expected).abs().max()
        torch_compiled = (compiled(**decode) - expected).abs().max()
    return {
        "decode": float(d),
        "prefill": float(p),
        "torch_comm_eager": float(torch_eager),
        "torch_comm_compiled": float(torch_compiled),
        "scale": float(expected.abs().max()),
    }


def lockstep(ctx: Ctx) -> dict[str, Any]:
    """Ranks that choose different keys are stopped before their collectives pair up wrongly."""
    model = ctx.model("paged", ctx.comms[0])
    runner = tp_decode_runner(model, mode=ctx.modes[0], sizes=DECODE_SIZES, check_lockstep=True)
    runner.capture()
    n = 1 if ctx.rank == 0 else 3
    batch = make_decode_batch(model, n, seed=5)
    start = time.perf_counter()
    try:
        runner.run(**batch)
        found: dict[str, Any] = {"raised": None}
    except ReplayError as exc:
        found = {"raised": _error(exc, start)}
    same = make_decode_batch(model, 4, seed=6)
    found["same_key_after"] = runner.run(copy=True, **same).shape[0]  # the ranks are still in step
    runner.close()
    return found


def capture_error(ctx: Ctx) -> dict[str, Any]:
    """Rank 1 fails capturing one key; every rank raises, naming rank 1 and the key."""
    model = ctx.model("paged", ctx.comms[0])

    def forward(**inputs: torch.Tensor) -> torch.Tensor:
        logits = model.decode_step(**inputs)
        if ctx.rank == 1 and is_capturing() and logits.shape[0] == FAIL_AT:
            raise RuntimeError("injected failure while capturing")
        return logits

    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=reference_inputs(model, "decode"),
        sizes=DECODE_SIZES,
        mode="full",
        device=ctx.device,
        process_group=ctx.group,
    )
    start = time.perf_counter()
    try:
        runner.capture()
        found: dict[str, Any] = {"raised": None}
    except CaptureError as exc:
        found = {"raised": _error(exc, start)}
    found["keys_left"] = [str(k) for k in runner.backend.captured_keys()]
    runner.close()
    return found


def different_keys(ctx: Ctx) -> dict[str, Any]:
    """Ranks built with different sizes are stopped before their first warm-up, each rank's keys named."""
    model = ctx.model("paged", ctx.comms[0])
    sizes = [1, 2, 4] if ctx.rank == 0 else [1, 2, 8]
    runner = tp_decode_runner(model, mode=ctx.modes[0], sizes=sizes)
    reduces = [0]
    original = model.comm.all_reduce

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        reduces[0] += 1
        return original(tensor)

    model.comm.all_reduce = all_reduce  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        runner.capture()
        found: dict[str, Any] = {"raised": None}
    except CaptureError as exc:
        found = {"raised": _error(exc, start)}
    found["all_reduces_run"] = reduces[0]
    runner.close()
    return found


def _die_or_stall(ctx: Ctx, how: str) -> dict[str, Any]:
    """Rank 1 is lost at the decode key FAIL_AT: killed or hung before its warm-ups, or killed in the
    middle of a warm-up (after one all-reduce, so rank 0 has queued collectives nobody will join)."""
    model = ctx.model("paged", ctx.comms[0])
    at: list[GraphKey] = []
    reduces = [0]

    def lose_rank_1() -> None:
        ctx.results["rank1_at"] = time.time()
        ctx.save()
        if how == "stall":
            time.sleep(ranks.rank_timeout_s() + 4)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_key(key: GraphKey) -> None:
        at.append(key)
        if ctx.rank == 1 and key.tokens == FAIL_AT and how != "kill_in_warmup":
            lose_rank_1()

    if ctx.rank == 1 and how == "kill_in_warmup":
        original = model.comm.all_reduce

        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            out = original(tensor)
            if at and at[-1].tokens == FAIL_AT:
                reduces[0] += 1
                if reduces[0] == 2:
                    lose_rank_1()
            return out

        model.comm.all_reduce = all_reduce  # type: ignore[method-assign]

    runner = tp_decode_runner(model, mode=ctx.modes[0], sizes=DECODE_SIZES, capture_context=on_key)
    start = time.perf_counter()
    try:
        runner.capture()
        found: dict[str, Any] = {"raised": None}
    except CaptureError as exc:
        found = {"raised": _error(exc, start), "raised_at": time.time()}
    found["timeout_s"] = ranks.rank_timeout_s()
    runner.close()
    # The process group lost a rank: an engine exits now, without tearing the group down. On GPUs destroying
    # a communicator whose peer is gone may block; on gloo, its threads may abort the process at exit
    # ("terminate called without an active exception"). The findings are saved first.
    ctx.hard_exit = True
    return found


def kill(ctx: Ctx) -> dict[str, Any]:
    """Rank 1 is killed while capturing; rank 0 stops with a clear error within the timeout."""
    return _die_or_stall(ctx, "kill")


def kill_in_warmup(ctx: Ctx) -> dict[str, Any]:
    """Rank 1 is killed half-way through a warm-up; rank 0 stops (aborting the group if it must)."""
    return _die_or_stall(ctx, "kill_in_warmup")


def stall(ctx: Ctx) -> dict[str, Any]:
    """Rank 1 hangs while capturing; rank 0 stops with a clear error once the timeout has passed."""
    return _die_or_stall(ctx, "stall")


def _captured_runner(ctx: Ctx, group: Any) -> tuple[GraphRunner, TPReferenceModel]:
    model = ctx.model("paged", ctx.comms[0], group=group)
    runner = tp_decode_runner(model, mode=ctx.modes[0], sizes=[1, 2])
    runner.capture()
    runner.run(**make_decode_batch(model, 2, seed=8))
    return runner, model


def teardown(ctx: Ctx) -> dict[str, Any]:
    """Close order. The group destroyed first: its runners are closed first (devgraph's guard on
    torch.distributed.destroy_process_group); devgraph's own destroy; close() then destroy. Ends with no
    process group."""
    found: dict[str, Any] = {}
    # 1. torch.distributed.destroy_process_group(group) with a live runner (a subgroup: the world lives on).
    sub = dist.new_group([0, 1])
    runner, _ = _captured_runner(ctx, sub)
    start = time.perf_counter()
    dist.destroy_process_group(sub)
    closed_by_destroy = runner.life.state is LifeState.CLOSED
    runner.close()  # a no-op now
    found["destroy_first"] = {
        "seconds": time.perf_counter() - start,
        "closed_by_destroy": closed_by_destroy,
        "group_alive": ranks.group_alive(sub),
    }
    # 2. devgraph.ranks.destroy_process_group(group): the same, called by name.
    sub = dist.new_group([0, 1])
    runner, _ = _captured_runner(ctx, sub)
    start = time.perf_counter()
    ranks.destroy_process_group(sub)
    found["devgraph_destroy"] = {
        "seconds": time.perf_counter() - start,
        "closed_by_destroy": runner.life.state is LifeState.CLOSED,
        "group_alive": ranks.group_alive(sub),
    }
    # 3. The documented order on the world group: close(), then destroy.
    runner, _ = _captured_runner(ctx, ctx.group)
    start = time.perf_counter()
    runner.close()
    dist.destroy_process_group()
    found["close_then_destroy"] = {
        "seconds": time.perf_counter() - start,
        "initialized": dist.is_initialized(),
    }
    return found


def destroy_bypassed(ctx: Ctx) -> dict[str, Any]:
    """torch's own destroy_process_group (the guard bypassed) with a live runner, then close(): what the
    communicator does, and that close() neither fails nor hangs. Run where a hang may not hurt others."""
    from devgraph.ranks import teardown as guard

    sub = dist.new_group([0, 1])
    runner, _ = _captured_runner(ctx, sub)
    original = guard._original_destroy
    assert original is not None, "the first runner with a process group installs the guard"
    ctx.results["destroy_bypassed_started"] = time.time()
    ctx.save()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (original(sub), done.set()), daemon=True)
    start = time.perf_counter()
    thread.start()
    returned = done.wait(15)
    found: dict[str, Any] = {
        "destroy_returned_within_15s": returned,
        "destroy_seconds": time.perf_counter() - start,
    }
    start = time.perf_counter()
    runner.close()
    found["close_seconds"] = time.perf_counter() - start
    found["close_kept_graphs"] = len(guard._kept)
    if not returned:  # releasing the graphs may be what the communicator waited for
        found["destroy_returned_after_close"] = done.wait(15)
    ctx.hard_exit = not done.is_set()
    return found


def compiled_full(ctx: Ctx) -> dict[str, Any]:
    """Decode under ``full`` with a compiler, collectives inside the compiled forward: with the custom-op
    communicator (``op``, opaque to dynamo) and with ``torch.distributed`` calls (``torch``, which dynamo
    rewrites into functional collectives); graph equals eager TP on both ranks."""
    out: dict[str, Any] = {}
    for comm in ("op", "torch"):
        model = ctx.model("paged", comm)
        config = json.dumps({"decode": {"backend": "full", "compiler": ctx.compiler}})
        start = time.perf_counter()
        runner = tp_decode_runner(model, config=config, sizes=DECODE_SIZES, check_lockstep=True)
        report = runner.capture()
        out[comm] = {
            "capture_seconds": time.perf_counter() - start,
            "compile": runner.inspect().get("compile"),
            "notes": report.notes,
            "steps": _steps(ctx, runner, model, "decode"),
        }
        runner.close()
    return out


class _DecliningOddRows(FullGraphBackend):
    """``full`` that vetoes steps with an odd number of real rows: a backend veto that every rank gives
    alike, so the fallback graph set replays those steps on every rank."""

    def can_run(self, batch: Batch) -> bool:
        return batch.n % 2 == 0


def fallback(ctx: Ctx) -> dict[str, Any]:
    """Decode under ``full`` with a ``breakable`` fallback set (the flag's ``fallback``): the steps ``full``
    declines replay the fallback's graphs, collectives inside both sets; graph equals eager TP."""
    out: dict[str, Any] = {}
    config = json.dumps({"decode": {"backend": "full", "fallback": "breakable"}})
    for comm in ctx.comms:
        model = ctx.model("paged", comm)
        platform = resolve_platform(ctx.device.type)
        runner = tp_decode_runner(
            model,
            config=config,
            sizes=DECODE_SIZES,
            check_lockstep=True,
            backend=_DecliningOddRows(platform, phase="decode"),
        )
        report = runner.capture()
        steps = _steps(ctx, runner, model, "decode")
        stats = runner.stats()
        out[comm] = {
            "fallback_keys": sorted(r.key.tokens for r in report.fallback),
            "steps": steps,
            "replays": stats["replays"],
            "eager": stats["eager"],
            "fallback": stats["fallback"],
        }
        runner.close()
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def symm(ctx: Ctx) -> dict[str, Any]:
    """``comm="symm"``: on the CPU (gloo) every rank falls back to ``op`` and logs why; on GPUs (NCCL) the
    symmetric-memory all-reduce equals the sum at every size (one-shot, two-shot, NCCL beyond the buffer),
    and a decode graph under ``full`` equals eager and the ``torch`` communicator's model."""
    records = _Records()
    comm_logger = logging.getLogger("devgraph.reference.tp.comm")
    comm_logger.addHandler(records)
    comm_logger.setLevel(logging.INFO)
    try:
        model = ctx.model("paged", "symm")
    finally:
        comm_logger.removeHandler(records)
    comm = model.comm
    out: dict[str, Any] = {
        "mode": comm.mode,
        "fallback_reason": comm.fallback_reason,
        "log": records.lines,
        "symm": repr(comm.symm) if comm.symm is not None else None,
    }
    # Direct all-reduces of known values through a bf16 communicator with small limits, so each plan runs:
    # one-shot (1, 8 rows), two-shot (64 rows), NCCL past the buffer (300 rows), and a partial at an odd
    # offset (two-shot through the buffer). Each rank contributes (rank + 1) * (column % 5 + 1).
    from devgraph.reference.tp.comm import TPComm

    hidden, dtype = 512, torch.bfloat16
    direct = TPComm(
        ctx.group, "symm", ctx.device, dtype=dtype, max_bytes=256 << 10, symm_one_shot_max=16 << 10
    )
    out["direct_mode"] = direct.mode
    out["direct_fallback_reason"] = direct.fallback_reason
    checks: dict[str, Any] = {}
    want = sum(r + 1 for r in range(ctx.world))
    pattern = (torch.arange(hidden, device=ctx.device) % 5 + 1).to(dtype)
    for name, rows, offset in (("1", 1, 0), ("8", 8, 0), ("64", 64, 0), ("300", 300, 0), ("8+odd", 8, 1)):
        base = torch.zeros(rows * hidden + offset, dtype=dtype, device=ctx.device)
        x = base[offset:].view(rows, hidden)
        x.copy_(pattern.repeat(rows, 1) * (ctx.rank + 1))
        plan = direct.symm.plan(x) if direct.symm is not None else direct.mode
        direct.all_reduce(x)
        expected = pattern.repeat(rows, 1) * want
        checks[name] = {"plan": plan, "max_abs_diff": float((x.float() - expected.float()).abs().max())}
    out["all_reduce"] = checks
    # Decode graphs under full: graph vs eager on this model, and against the torch communicator's model.
    runner = tp_decode_runner(model, mode="full", sizes=DECODE_SIZES, check_lockstep=True)
    runner.capture()
    plain = ctx.model("paged", "torch" if ctx.cuda else "op")
    steps = []
    for n in DECODE_SIZES:
        batch = make_decode_batch(model, n, seq_lens=16, seed=n)
        with torch.no_grad():
            graph = runner.run(**batch).float()
            eager = model.decode_step(**batch).float()
            other = plain.decode_step(**batch).float()
        steps.append(
            {
                "n": n,
                "graph_vs_eager": float((graph - eager).abs().max()),
                "vs_torch_comm": float((eager - other).abs().max()),
                "scale": float(eager.abs().max()),
            }
        )
    runner.close()
    out["steps"] = steps
    return out


def fused(ctx: Ctx) -> dict[str, Any]:
    """The fused all-reduce + add (+ RMSNorm) kernel (``symm`` with Triton): on the CPU (gloo) nothing is set
    up; on GPUs it equals NCCL's sum followed by the add-and-norm kernel, eagerly at 1, 3, 64 and 128 rows of
    two widths (and refuses 129), inside two CUDA graphs of different row counts replayed alternately with
    new inputs (the flags carry over between graphs), in 48 calls back to back of mixed widths and row
    counts with no host sync (ranks compared bit for bit), and in the model's eager steps and decode graphs
    against the same model with the all-reduce unfused."""
    from devgraph.reference.tp.comm import FUSED_MAX_ROWS, TPComm

    dtype = torch.bfloat16
    direct = TPComm(ctx.group, "symm", ctx.device, dtype=dtype, max_bytes=4 << 20, fuse=True)
    out: dict[str, Any] = {
        "mode": direct.mode,
        "fallback_reason": direct.fallback_reason,
        "fused": repr(direct.fused) if direct.fused is not None else None,
        "fused_reason": direct.fused_reason,
    }
    if direct.fused is None:
        return out
    from devgraph.reference.kernels.triton_fused import rms_norm

    eps = 1e-6

    def inputs(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shared = torch.Generator(device=ctx.device).manual_seed(seed)
        mine = torch.Generator(device=ctx.device).manual_seed(seed * 10 + ctx.rank + 1)
        partial = torch.randn((rows, cols), generator=mine, device=ctx.device).to(dtype)
        residual = torch.randn((rows, cols), generator=shared, device=ctx.device).to(dtype)
        weight = torch.rand(cols, generator=shared, device=ctx.device).to(dtype)
        return partial, residual, weight

    def reference(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Any:
        summed = partial.clone()
        dist.all_reduce(summed, group=ctx.group)
        return rms_norm(summed, weight, eps, residual)  # (normed, total)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max())

    eager: dict[str, Any] = {}
    for cols in (1024, 4096):
        for rows in (1, 3, 64, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1):
            partial, residual, weight = inputs(rows, cols, rows + cols)
            got = direct.all_reduce_add(partial, residual, weight, eps)
            plain = direct.all_reduce_add(partial, residual, None, eps)
            want_normed, want_total = reference(partial, residual, weight)
            if got is None or plain is None:
                eager[f"{rows}x{cols}"] = {"fused": False}
                continue
            eager[f"{rows}x{cols}"] = {
                "fused": True,
                "total": diff(got[1], want_total),
                "total_without_norm": diff(plain[1], want_total),
                "normed": diff(got[0], want_normed),
                "no_normed_without_weight": plain[0] is None,
            }
    out["eager"] = eager
    # Two graphs, 1 and 8 rows, each three chained calls; replayed alternately with new inputs.
    graphs: dict[int, Any] = {}
    static: dict[int, tuple[torch.Tensor, ...]] = {}
    pool = torch.cuda.graph_pool_handle()
    for rows in (1, 8):
        partial, residual, weight = inputs(rows, 1024, 7)

        def chain(partial=partial, residual=residual, weight=weight) -> torch.Tensor:
            normed, total = direct.all_reduce_add(partial, residual, weight, eps)
            _, total = direct.all_reduce_add(normed, total, None, eps)
            normed, total = direct.all_reduce_add(partial, total, weight, eps)
            return normed + total

        chain()  # warm-up (builds the kernels)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            result = chain()
        graphs[rows], static[rows] = graph, (partial, residual, weight, result)

    def chain_reference(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed, total = reference(partial, residual, weight)
        summed = normed.clone()
        dist.all_reduce(summed, group=ctx.group)
        total = (summed.float() + total.float()).to(dtype)
        normed, total = reference(partial, total, weight)
        return normed + total

    worst = 0.0
    for step, rows in enumerate([1, 8, 8, 1, 8, 1, 1, 8] * 6):
        partial, residual, weight, result = static[rows]
        fresh = inputs(rows, 1024, 100 + step)
        for dst, src in zip((partial, residual, weight), fresh, strict=True):
            dst.copy_(src)
        graphs[rows].replay()
        worst = max(worst, diff(result, chain_reference(*fresh)))
    torch.cuda.synchronize()
    out["graphs_alternating_max_diff"] = worst
    # Back to back, eagerly, no host sync between calls: new inputs every call, row counts below and above
    # the 32 programs and two widths alternating on the one buffer (each program keeps its own slab).
    shapes = [(1, 1024), (40, 4096), (8, 1024), (100, 4096), (3, 4096), (33, 1024)] * 8
    made = [inputs(rows, cols, 1000 + k) for k, (rows, cols) in enumerate(shapes)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = [direct.all_reduce_add(p, r, w if k % 3 else None, eps) for k, (p, r, w) in enumerate(made)]
    torch.cuda.synchronize()
    out["back_to_back_us"] = (time.perf_counter() - start) / len(made) * 1e6
    totals, normed_worst = 0.0, 0.0
    digest = hashlib.sha256()
    for k, ((p, r, w), got) in enumerate(zip(made, results, strict=True)):
        assert got is not None
        want_normed, want_total = reference(p, r, w)
        totals = max(totals, diff(got[1], want_total))
        if k % 3:
            normed_worst = max(normed_worst, diff(got[0], want_normed))
        for t in got:
            if t is not None:
                digest.update(t.float().cpu().numpy().tobytes())
    out["back_to_back_calls"] = len(made)
    out["back_to_back_total"] = totals
    out["back_to_back_normed"] = normed_worst
    out["back_to_back_digest"] = digest.hexdigest()  # every rank's outputs, to compare across ranks
    # The model: fused against unfused, eagerly before any capture, then replayed, then eagerly again; and
    # fused with no eager step before the capture.
    from devgraph.reference.tp.comm import FusedAllReduce

    fused_calls = [0]
    launch = FusedAllReduce.all_reduce_add

    def counted(self: Any, *args: Any) -> Any:
        fused_calls[0] += 1
        return launch(self, *args)

    FusedAllReduce.all_reduce_add = counted  # type: ignore[method-assign]
    runs: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for label, fuse, eager_first in (("fused", True, True), ("unfused", False, True), ("late", True, False)):
        model = TPReferenceModel(
            ctx.config("paged"), ctx.group, device=ctx.device, seed=0, comm="symm", fuse_all_reduce=fuse
        )
        model.randomize_cache(seed=1)
        out[f"model_{label}_fused"] = model.comm.fused is not None
        batches = {n: make_decode_batch(model, n, seq_lens=16, seed=n) for n in DECODE_SIZES}
        runs[label] = {n: {} for n in DECODE_SIZES}
        calls_before = fused_calls[0]
        with torch.no_grad():
            for n, batch in batches.items():
                if eager_first:
                    runs[label][n]["eager_before"] = model.decode_step(**batch).float()
        # How many fused calls the eager steps made: two a layer a step where the model took the kernel.
        out[f"model_{label}_eager_fused_calls"] = fused_calls[0] - calls_before
        out["layers"] = model.config.num_layers
        runner = tp_decode_runner(model, mode="full", sizes=DECODE_SIZES, check_lockstep=True)
        runner.capture()
        with torch.no_grad():
            for n, batch in batches.items():
                # clone: the replay's output is the graph's buffer, which the next replay rewrites
                runs[label][n]["graph"] = runner.run(**batch).float().clone()
                runs[label][n]["eager_after"] = model.decode_step(**batch).float()
        torch.cuda.synchronize()
        runner.close()
    reference_logits = {n: runs["unfused"][n]["eager_before"] for n in DECODE_SIZES}
    out["model"] = {
        str(n): {
            f"{label}_{when}": diff(got, reference_logits[n])
            for label, by_size in runs.items()
            for when, got in by_size[n].items()
        }
        | {"scale": float(reference_logits[n].abs().max())}
        for n in DECODE_SIZES
    }
    return out


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "symm": symm,
    "fused": fused,
    "fallback": fallback,
    "equivalence": equivalence,
    "compiled_full": compiled_full,
    "lockstep": lockstep,
    "capture_error": capture_error,
    "different_keys": different_keys,
    "kill": kill,
    "kill_in_warmup": kill_in_warmup,
    "stall": stall,
    "teardown": teardown,
    "destroy_bypassed": destroy_bypassed,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenarios", help=f"comma list of: {', '.join(SCENARIOS)}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--modes", default="full,breakable,tc_piecewise")
    parser.add_argument("--comms", default="auto")
    parser.add_argument("--compiler", default="eager", help="compiled_full's compiler (eager or inductor)")
    parser.add_argument("--group-timeout", type=float, default=60.0, help="the process group's own timeout")
    args = parser.parse_args(argv)
    ctx = Ctx(args)
    backend = "nccl" if ctx.cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.group_timeout))
    ctx.group = dist.group.WORLD
    status = 0
    for name in args.scenarios.split(","):
        start = time.perf_counter()
        try:
            ctx.results[name] = SCENARIOS[name](ctx)
        except BaseException as exc:  # record it and go on: the test names what failed
            ctx.results[name] = {"crashed": _error(exc, start), "traceback": traceback.format_exc()}
            status = 1
        ctx.results[name + "_seconds"] = time.perf_counter() - start
        ctx.save()
    if ctx.hard_exit:
        os._exit(status)
    if dist.is_initialized():
        ranks.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
