"""Tensor-parallel all-reduce inside CUDA graphs: NCCL against torch symmetric memory (``comm="symm"``).

Two ranks spawned here (torch.multiprocessing, NCCL, one GPU each; NVLS kept off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1)::

    python benchmarks/bench_tp_comm.py                      # 2 GPUs; $OUT/tp-comm.json (+ .png)
    python benchmarks/bench_tp_comm.py --smoke              # CPU, gloo: the fallback only

Per message size ([1, 8, 32, 64, 256] x 4096 bf16, the decode step's all-reduce at those batches): one CUDA
graph per method of ``--calls`` (64, as one decode step of a 32-layer model) back-to-back in-place
all-reduces, replayed ``--replays`` times in ``--rounds`` interleaved rounds; CUDA events; per-call
microseconds = graph time / calls (the graph's one reset copy included), median over rounds, rank 0's.
Methods: ``nccl`` (``dist.all_reduce``), ``symm`` (:class:`~devgraph.reference.tp.TPComm` ``"symm"``: the
plan it picks), and the forced plans ``one_shot_copy``, ``two_shot_out``, ``two_shot`` (to set the one-shot
limit). Each result is checked against the known sum. Then, unless past the budget, a few decoder layers at
8B widths: the decode step's ``full`` graph with ``comm="torch"`` and ``comm="symm"``.

Every failure (import, rendezvous, capture, a wrong sum, a rank that stops answering) is written into the
JSON as an error string; the parent stops the ranks at ``--deadline`` seconds (default 55).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform as host_platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from harness.device import Device
from harness.profile import kernel_times

SIZES = (1, 8, 32, 64, 256)
HIDDEN = 4096
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FORCED = ("one_shot_copy", "two_shot_out", "two_shot")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:600]


class Rank:
    """One rank's state; ``save()`` after each measurement so a rank stopped mid-way leaves what it had."""

    def __init__(self, rank: int, world: int, work: Path, args: argparse.Namespace) -> None:
        self.rank, self.world, self.work, self.args = rank, world, work, args
        self.start = time.perf_counter()
        self.found: dict[str, Any] = {"rank": rank, "errors": {}, "sizes": {}, "progress": "started"}

    def save(self) -> None:
        path = self.work / f"rank{self.rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.found, indent=1, default=str))
        path.with_suffix(".tmp").replace(path)

    def error(self, where: str, exc: BaseException | str) -> None:
        self.found["errors"][where] = exc if isinstance(exc, str) else _err(exc)
        if not isinstance(exc, str):
            self.found["errors"][where + "/traceback"] = traceback.format_exc()[-2000:]
        self.save()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _agree(ok: bool, device: torch.device) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _go(r: Rank, device: torch.device, budget: float) -> bool:
    """Rank 0's decision whether there is time left, made by every rank."""
    import torch.distributed as dist

    flag = torch.tensor([1 if r.elapsed() < budget else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _time_graph(graph: Any, replays: int, rounds: int, calls: int) -> list[float]:
    """Per-call microseconds of each round (CUDA events around ``replays`` replays)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    return out


def micro(r: Rank, device: torch.device) -> None:
    """NCCL vs symm (and the forced plans) per size, each in a graph of ``calls`` all-reduces."""
    import torch.distributed as dist

    from devgraph.reference.tp.comm import TPComm

    args, dtype = r.args, torch.bfloat16
    comm: Any = None
    try:
        comm = TPComm(
            dist.group.WORLD,
            "symm",
            device,
            dtype=dtype,
            max_bytes=max(SIZES) * HIDDEN * dtype.itemsize,
            symm_one_shot_max=args.one_shot_max,
        )
        r.found["comm"] = repr(comm)
        r.found["symm_buffer"] = repr(comm.symm)
        if comm.symm is None:
            r.error("symm_setup", f"fell back to {comm.mode!r}: {comm.fallback_reason}")
    except Exception as exc:  # noqa: BLE001 - recorded; the NCCL half still runs
        r.error("symm_setup", exc)
        comm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        r.found["symm_backend"] = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None
    except Exception as exc:  # noqa: BLE001
        r.found["symm_backend"] = _err(exc)
    symm_ok = comm is not None and comm.symm is not None
    want = sum(k + 1 for k in range(r.world))
    pool = torch.cuda.graph_pool_handle()
    for tokens in SIZES:
        if not _go(r, device, args.deadline * 0.45):
            r.error(f"size {tokens}", "skipped: past the time budget")
            continue
        pattern = (torch.arange(HIDDEN, device=device) % 5 + 1).to(dtype).repeat(tokens, 1)
        x0 = pattern * (r.rank + 1)
        x = x0.clone()
        methods: dict[str, Callable[[], None]] = {"nccl": lambda x=x: dist.all_reduce(x)}
        if symm_ok:
            methods["symm"] = lambda x=x: comm.all_reduce(x)
            for plan in FORCED:
                methods[plan] = lambda p=plan, x=x: comm.symm.all_reduce(x, p)
        row: dict[str, Any] = {"bytes": tokens * HIDDEN * dtype.itemsize, "per_call_us": {}, "errors": {}}
        if symm_ok:
            row["symm_plan"] = comm.symm.plan(x)
        graphs: dict[str, Any] = {}
        for name, call in methods.items():
            ok, problem = True, ""
            try:
                # Eager once, checked: one all-reduce of known values.
                x.copy_(x0)
                call()
                torch.cuda.synchronize()
                if not torch.equal(x, pattern * want):
                    ok, problem = (
                        False,
                        f"eager sum wrong (max diff {(x.float() - pattern.float() * want).abs().max()})",
                    )
                if ok:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):  # a warm-up on the side stream, as the runners do
                        x.copy_(x0)
                        call()
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        x.copy_(x0)
                        for _ in range(args.calls):
                            call()
                    graphs[name] = graph
            except Exception as exc:  # noqa: BLE001 - recorded below, agreed on by every rank
                ok, problem = False, _err(exc)
            if not _agree(ok, device):
                row["errors"][name] = problem or "failed on another rank"
                graphs.pop(name, None)
                continue
            # One replay checked: calls in-place all-reduces of x0 -> x0 summed, then doubled calls-1 times
            # ... exactly: each call sums the ranks' (equal after the first) values.
            try:
                graphs[name].replay()
                torch.cuda.synchronize()
                expected = pattern.float() * want * float(r.world) ** (args.calls - 1)
                if not torch.equal(x.float(), expected):
                    ok, problem = False, "graph replay sum wrong"
            except Exception as exc:  # noqa: BLE001
                ok, problem = False, _err(exc)
            if not _agree(ok, device):
                row["errors"][name] = problem or "replay failed on another rank"
                graphs.pop(name, None)
        samples: dict[str, list[float]] = {name: [] for name in graphs}
        for _ in range(args.rounds):  # interleaved: every rank replays the same graphs in the same order
            for name, graph in graphs.items():
                samples[name] += _time_graph(graph, args.replays, 1, args.calls)
        row["per_call_us"] = {name: statistics.median(s) for name, s in samples.items() if s}
        if "nccl" in row["per_call_us"]:
            base = row["per_call_us"]["nccl"]
            row["ratio_vs_nccl"] = {n: us / base for n, us in row["per_call_us"].items()}
        r.found["sizes"][str(tokens)] = row
        r.found["progress"] = f"size {tokens} done"
        r.save()
        del graphs
    if comm is not None:
        r.found["symm_final"] = repr(comm)


def _kernel_table(step: Callable[[], Any], steps: int, top: int = 14) -> dict[str, float]:
    """Device microseconds per step by kernel name (torch.profiler over ``steps`` steps), the ``top``
    kernels and the rest summed; "total" is every kernel's."""
    times: dict[str, float] = {}
    for name, (_, us) in kernel_times(step, steps).items():  # names cut to 90 characters may meet: summed
        times[name[:90]] = times.get(name[:90], 0.0) + us
    ranked = sorted(times.items(), key=lambda item: -item[1])
    table = {name: round(us, 2) for name, us in ranked[:top]}
    table["(the rest)"] = round(sum(us for _, us in ranked[top:]), 2)
    table["total"] = round(sum(times.values()), 2)
    return table


def _ms_per_step(device: torch.device, step: Callable[[], Any], steps: int) -> float:
    """Device milliseconds per call of ``step`` over ``steps`` calls back to back (CUDA events around them
    all: :meth:`harness.device.Device.time_step` of the loop)."""
    latency_ms, _ = Device(device).time_step(lambda: [step() for _ in range(steps)])
    return latency_ms / steps


def _one_gpu(config: Any, device: torch.device, steps: int, batches: tuple[int, ...]) -> dict[str, Any]:
    """The same layers on this GPU alone (the plain reference model): its decode step at each batch, timed
    and by kernel, beside the tensor-parallel one."""
    from devgraph.reference import ReferenceModel, decode_runner, make_decode_batch

    model = ReferenceModel(config, device=device, seed=0)
    model.randomize_cache(seed=0)
    runner = decode_runner(model, mode="full", sizes=list(batches), progress=False)
    row: dict[str, Any] = {}
    try:
        runner.capture()
        for n in batches:
            batch = make_decode_batch(model, n, seq_lens=256, seed=n)
            with torch.no_grad():
                for _ in range(3):
                    runner.run(**batch)
                row[f"batch{n}_ms_per_step"] = _ms_per_step(
                    device, functools.partial(runner.run, **batch), steps
                )
            row[f"batch{n}_kernels_us_per_step"] = _kernel_table(
                functools.partial(runner.run, **batch), steps
            )
        return row
    finally:
        runner.close()
        del model, runner
        torch.cuda.empty_cache()


def decode_model(r: Rank, device: torch.device) -> None:
    """A few layers at 8B widths: the decode ``full`` graph with comm="torch" and comm="symm"."""
    import torch.distributed as dist

    from devgraph.reference import ReferenceConfig, make_decode_batch
    from devgraph.reference.tp import TPReferenceModel, tp_decode_runner

    args = r.args
    config = ReferenceConfig(
        vocab_size=32768,
        hidden_size=4096,
        num_layers=args.layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        max_requests=64,
        max_seq_len=512,
        dtype=torch.bfloat16,
    )
    batches = (1, 64)
    out: dict[str, Any] = {
        "layers": args.layers,
        "batches": list(batches),
        "all_reduces_per_step": 2 * args.layers,
    }
    logits: dict[str, dict[int, torch.Tensor]] = {}
    # symm: the all-reduce alone (fuse_all_reduce=False); symm_fused: with the add and norm in one kernel.
    for comm in ("torch", "symm", "symm_fused"):
        if not _go(r, device, args.deadline * 0.8):
            out[comm] = {"error": "skipped: past the time budget"}
            continue
        t0 = time.perf_counter()
        model = runner = None
        try:
            model = TPReferenceModel(
                config,
                dist.group.WORLD,
                device,
                seed=0,
                comm=comm.removesuffix("_fused"),
                exact_weights=False,
                fuse_all_reduce=comm.endswith("_fused"),
            )
            model.randomize_cache(seed=0)
            runner = tp_decode_runner(model, mode="full", sizes=list(batches), progress=False)
            runner.capture()
            row: dict[str, Any] = {
                "mode": model.comm.mode,
                "fallback_reason": model.comm.fallback_reason,
                "fused": repr(model.comm.fused) if model.comm.fused is not None else None,
                "fused_reason": model.comm.fused_reason,
            }
            row["build_capture_s"] = time.perf_counter() - t0
            logits[comm] = {}
            for n in batches:
                batch = make_decode_batch(model, n, seq_lens=256, seed=n)
                with torch.no_grad():
                    # clone: a replay's output is the graph's buffer, which the next replay rewrites
                    logits[comm][n] = runner.run(**batch).float().clone()
                    for _ in range(3):
                        runner.run(**batch)
                    torch.cuda.synchronize()
                    dist.barrier()
                    row[f"batch{n}_ms_per_step"] = _ms_per_step(
                        device, functools.partial(runner.run, **batch), args.steps
                    )
            if args.profile_kernels:
                for n in batches:
                    batch = make_decode_batch(model, n, seq_lens=256, seed=n)
                    row[f"batch{n}_kernels_us_per_step"] = _kernel_table(
                        functools.partial(runner.run, **batch), args.steps
                    )
            out[comm] = row
        except Exception as exc:  # noqa: BLE001 - recorded; the ranks may be out of step now
            out[comm] = {"error": _err(exc), "traceback": traceback.format_exc()[-2000:]}
            r.found["decode_model"] = out
            r.save()
            raise
        finally:
            if runner is not None:
                runner.close()
            del model, runner
            torch.cuda.empty_cache()
        r.found["decode_model"] = out
        r.save()
    if args.profile_kernels and r.rank == 0 and _go(r, device, args.deadline * 0.8):
        out["one_gpu"] = _one_gpu(config, device, args.steps, batches)
    for name in ("symm", "symm_fused"):
        if "torch" not in logits or name not in logits:
            continue
        out[f"max_abs_diff_{name}_vs_torch"] = {
            str(n): float((logits[name][n] - logits["torch"][n]).abs().max()) for n in batches
        }
        rows = [out["torch"], out[name]]
        out[f"{name}_over_torch"] = {
            str(n): rows[1][f"batch{n}_ms_per_step"] / rows[0][f"batch{n}_ms_per_step"] for n in batches
        }
    if "symm" in logits and "symm_fused" in logits:
        out["max_abs_diff_symm_fused_vs_symm"] = {
            str(n): float((logits["symm_fused"][n] - logits["symm"][n]).abs().max()) for n in batches
        }
        out["symm_fused_over_symm"] = {
            str(n): out["symm_fused"][f"batch{n}_ms_per_step"] / out["symm"][f"batch{n}_ms_per_step"]
            for n in batches
        }
    r.found["decode_model"] = out
    r.save()


def smoke(r: Rank) -> None:
    """CPU, gloo: symm asked, the fallback and its reason; gloo all-reduces checked (timing: host)."""
    import torch.distributed as dist

    from devgraph.reference.tp.comm import TPComm

    comm = TPComm(dist.group.WORLD, "symm", torch.device("cpu"), dtype=torch.bfloat16)
    r.found["comm"] = repr(comm)
    r.found["symm_skipped"] = f"NCCL vs symm needs 2 GPUs; on gloo symm falls back: {comm.fallback_reason}"
    want = sum(k + 1 for k in range(r.world))
    for tokens in SIZES:
        pattern = (torch.arange(HIDDEN) % 5 + 1).to(torch.bfloat16).repeat(tokens, 1)
        times = []
        ok = True
        for _ in range(5):
            x = pattern * (r.rank + 1)
            t0 = time.perf_counter()
            comm.all_reduce(x)
            times.append((time.perf_counter() - t0) * 1e6)
            ok = ok and torch.equal(x, pattern * want)
        r.found["sizes"][str(tokens)] = {
            "bytes": tokens * HIDDEN * 2,
            "per_call_us": {f"gloo ({comm.mode})": statistics.median(times)},
            "correct": ok,
        }
        r.save()


def rank_main(rank: int, world: int, port: int, work: str, args: argparse.Namespace) -> None:
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    os.environ.update(NVLS_OFF)
    r = Rank(rank, world, Path(work), args)
    r.save()
    import torch.distributed as dist

    try:
        if args.smoke:
            dist.init_process_group("gloo", timeout=timedelta(seconds=30))
            smoke(r)
        else:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group("nccl", timeout=timedelta(seconds=40), device_id=device)
            r.found["device"] = torch.cuda.get_device_name(device)
            if not args.no_micro:
                micro(r, device)
            if args.layers > 0:
                try:
                    decode_model(r, device)
                except Exception as exc:  # noqa: BLE001
                    r.error("decode_model", exc)
        r.found["progress"] = "done"
    except BaseException as exc:  # noqa: BLE001 - written down, never raised to the parent
        r.error("rank", exc)
    r.found["elapsed_s"] = r.elapsed()
    r.save()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def meta(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {
        "benchmark": "tensor-parallel all-reduce in CUDA graphs: NCCL vs torch symmetric memory",
        "torch": torch.__version__,
        "python": host_platform.python_version(),
        "command": " ".join(["python", *map(shlex.quote, sys.argv)]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "env": {**NVLS_OFF},
        "message": f"[tokens, {HIDDEN}] bfloat16, tokens in {list(SIZES)}",
        "timing": (
            f"CUDA events around {args.replays} replays of a graph of {args.calls} in-place all-reduces "
            f"(+1 reset copy), per call; median of {args.rounds} interleaved rounds; rank 0"
        ),
        "one_shot_max_bytes": args.one_shot_max,
    }
    if not args.smoke and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001
            info["nccl"] = _err(exc)
        try:
            info["p2p_0_1"] = (
                torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None
            )
        except Exception as exc:  # noqa: BLE001
            info["p2p_0_1"] = _err(exc)
    else:
        info["device"] = f"cpu ({host_platform.machine()}), gloo"
    return info


def plot(report: dict[str, Any], path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from harness.plots import Panel, plot_panels

    sizes = report.get("sizes", {})
    x = list(sizes)
    names = list(dict.fromkeys(n for row in sizes.values() for n in row.get("per_call_us", {})))
    series = {n: [sizes[s].get("per_call_us", {}).get(n) for s in x] for n in names}
    panels = [
        Panel(
            "all-reduce per call, in a CUDA graph",
            x,
            series,
            ylabel="us per call (median)",
            xlabel="tokens x 4096 bf16",
        )
    ]
    model = report.get("decode_model") or {}
    rows = {c: model.get(c) for c in ("torch", "symm", "symm_fused") if isinstance(model.get(c), dict)}
    if rows and all("batch1_ms_per_step" in v for v in rows.values()):
        xb = [str(b) for b in model.get("batches", [])]
        panels.append(
            Panel(
                f"decode step, {model.get('layers')} layers at 8B widths, TP=2",
                xb,
                {c: [v.get(f"batch{b}_ms_per_step") for b in xb] for c, v in rows.items()},
                xlabel="batch",
            )
        )
    plot_panels(
        path, panels, f"TP all-reduce, {report['meta'].get('device')}, torch {report['meta'].get('torch')}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/tp-comm.json, else results/)")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo: the fallback and gloo sums only")
    parser.add_argument("--calls", type=int, default=64, help="all-reduces per graph")
    parser.add_argument("--replays", type=int, default=20, help="replays per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers at 8B widths (0: skip)")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per batch")
    parser.add_argument(
        "--profile-kernels",
        action="store_true",
        help="the decode step's kernels at batch 1 and 64 by name (torch.profiler), and the same layers on "
        "one GPU",
    )
    parser.add_argument("--no-micro", action="store_true", help="skip the all-reduce sizes; the layers only")
    parser.add_argument("--one-shot-max", type=int, default=None, help="bytes (default: the module's)")
    parser.add_argument("--deadline", type=float, default=55.0, help="seconds; the ranks are stopped then")
    args = parser.parse_args()
    from devgraph.reference.tp.comm import SYMM_ONE_SHOT_MAX_BYTES

    args.one_shot_max = args.one_shot_max or SYMM_ONE_SHOT_MAX_BYTES
    if args.smoke:
        args.layers = 0
    os.environ.update(NVLS_OFF)
    world = 2
    report: dict[str, Any] = {"meta": meta(args), "errors": {}}
    if not args.smoke and (not torch.cuda.is_available() or torch.cuda.device_count() < world):
        report["errors"]["gpus"] = f"needs {world} GPUs; found {torch.cuda.device_count()}"
        per_rank: list[dict[str, Any]] = []
    else:
        import torch.multiprocessing as mp

        work = Path(tempfile.mkdtemp(prefix="tp-comm-"))
        start = time.perf_counter()
        ctx = mp.spawn(rank_main, args=(world, _free_port(), str(work), args), nprocs=world, join=False)
        while time.perf_counter() - start < args.deadline:
            try:
                if ctx.join(timeout=1):
                    break
            except Exception as exc:  # noqa: BLE001 - a rank died: record it, stop the other
                report["errors"]["spawn"] = _err(exc)
                break
        for proc in ctx.processes:
            if proc.is_alive():
                report["errors"][f"pid {proc.pid}"] = f"stopped at the {args.deadline:.0f} s deadline"
                proc.terminate()
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
        report["meta"]["elapsed_s"] = time.perf_counter() - start
        per_rank = []
        for k in range(world):
            path = work / f"rank{k}.json"
            try:
                per_rank.append(json.loads(path.read_text()))
            except Exception as exc:  # noqa: BLE001
                per_rank.append({"rank": k, "errors": {"read": _err(exc)}})
    report["per_rank"] = per_rank
    if per_rank:
        first = per_rank[0]
        report["sizes"] = first.get("sizes", {})
        report["decode_model"] = first.get("decode_model")
        report["comm"] = first.get("comm")
        report["symm_buffer"] = first.get("symm_buffer")
        for k, found in enumerate(per_rank):
            for where, what in found.get("errors", {}).items():
                if not where.endswith("/traceback"):
                    report["errors"][f"rank{k}/{where}"] = what
            for tokens, row in found.get("sizes", {}).items():
                for name, what in row.get("errors", {}).items():
                    report["errors"][f"rank{k}/size {tokens}/{name}"] = what
    sizes = report.get("sizes", {})
    report["summary_us"] = {
        t: {n: round(us, 2) for n, us in row.get("per_call_us", {}).items()} for t, row in sizes.items()
    }
    if os.environ.get("OUT"):
        default = Path(os.environ["OUT"]) / "tp-comm.json"
    else:
        tag = "cpu" if args.smoke else str(report["meta"].get("device", "gpu")).split()[-1].lower()
        default = Path(__file__).parent / "results" / f"{tag}-tp-comm.json"
    target = Path(args.out) if args.out else default
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1, default=str) + "\n")
    try:
        plot(report, target.with_suffix(".png"))
    except Exception as exc:  # noqa: BLE001 - the JSON is what matters
        print(f"plot failed: {_err(exc)}")
    print(
        json.dumps(
            {
                "summary_us": report["summary_us"],
                "decode_model": report.get("decode_model"),
                "errors": report["errors"],
            },
            indent=1,
            default=str,
        )[:6000]
    )
    print(f"wrote {target}")
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
