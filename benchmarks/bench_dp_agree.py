"""The cost of data-parallel key agreement per step: ``runner.agree()`` on a shared-memory board (ranks of
one host: the default), on the device (one NCCL all-reduce of a few int64 on a communicator of its own) and
on the host (gloo control group), next to the bare collectives under them and the tensor-parallel
lock-step check, on ranks launched here. Every agreement's answer is checked against the largest counts of
the step in the same run.

    python benchmarks/bench_dp_agree.py                       # 2 ranks on the CPU (gloo; board and host)
    python benchmarks/bench_dp_agree.py --device cuda         # 2 GPUs: NCCL group, board, device and host
    python benchmarks/bench_dp_agree.py --ranks 4 --iters 5000 --out results.json

Writes ``$OUT/dp-agree.json`` (or ``--out``; default ``benchmarks/results/<cpu|h100...>-dp-agree.json``):
the device, torch, gloo/NCCL, the command, and per rank the median and p90 microseconds per step of each
measured call. CPU numbers are CPU numbers: two processes on one host talking over loopback TCP.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
        "min_us": ordered[0] * 1e6,
    }


def _timed(call: Any, iters: int, warmup: int = 50) -> dict[str, float]:
    for _ in range(warmup):
        call(0)
    times = []
    for i in range(iters):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return _summary(times)


def _agreement_timings(runner: Any, rank: int, world: int, iters: int) -> dict[str, Any]:
    """``runner.agree()`` per step, each answer checked: every rank's count of step ``i`` is known here,
    so the agreed key must hold the largest of them."""
    wrong = 0

    def call(i: int) -> None:
        nonlocal wrong
        counts = [1 + (i * 7 + r * 3) % 16 for r in range(world)]
        agreement = runner.agree(counts[rank])
        if agreement.key is None or agreement.key.tokens < max(counts):
            wrong += 1

    timings = _timed(call, iters)
    return {**timings, "wrong_answers": wrong}


def rank_main(args: argparse.Namespace) -> int:
    from devgraph import ranks
    from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group = dist.group.WORLD
    model = ReferenceModel(ReferenceConfig.preset("tiny"), device=device, seed=0)
    ways = ["shm", "device", "host"] if args.device == "cuda" else ["shm", "host"]
    found: dict[str, Any] = {"rank": rank}
    for way in ways:
        os.environ[ranks.AGREEMENT_ENV] = way  # read when the runner's first agreement picks its transport
        runner = decode_runner(model, mode="full", sizes=[1, 2, 4, 8, 16], dp_group=group, progress=False)
        runner.capture()
        # The whole per-step cost an engine pays: counts, one all-reduce, routing the largest counts.
        found[f"agree_{way}"] = _agreement_timings(runner, rank, world, args.iters)
        found[f"agree_{way}"]["transport"] = runner.stats()["data_parallel"]["transport"]
        runner.close()
    control = ranks.control_group(group)
    message = torch.zeros(7, dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    # The same message on the same gloo group, without devgraph around it.
    found["gloo_allreduce"] = _timed(lambda i: control.allreduce([message], options).wait(), args.iters)
    if args.device == "cuda":
        on_device = message.to(device)

        def bare_nccl(i: int) -> None:  # the floor: an all-reduce on the device and one sync
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
            on_device.cpu()

        found["nccl_allreduce"] = _timed(bare_nccl, args.iters)
    keys_runner = decode_runner(
        model, mode="full", sizes=[1, 2, 4, 8, 16], process_group=group, progress=False
    )
    keys_runner.capture()
    # The tensor-parallel check (an all-gather of one int64), for comparison.
    found["lockstep_check"] = _timed(lambda i: ranks.assert_same_key(group, keys_runner.keys[0]), args.iters)
    keys_runner.close()
    Path(args.rank_out, f"rank{rank}.json").write_text(json.dumps(found))
    ranks.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_out:
        return rank_main(args)
    work = Path(tempfile.mkdtemp(prefix="dp-agree-"))
    port = _free_port()
    procs = []
    for rank in range(args.ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(args.ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, __file__, "--device", args.device, "--iters", str(args.iters)]
        procs.append(subprocess.Popen([*command, "--rank-out", str(work)], env=env))
    codes = [p.wait(timeout=600) for p in procs]
    per_rank = [json.loads((work / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    if args.device == "cuda":
        name = torch.cuda.get_device_name(0)
        tag = "h100" if "H100" in name else ("h200" if "H200" in name else "gpu")
        label = (
            f"{name} x{args.ranks}: NCCL process group; agree_shm on a shared-memory board (one host), "
            "agree_device on devgraph's own NCCL communicator, agree_host on its gloo control group "
            "(loopback)"
        )
    else:
        name, tag = "cpu", "cpu"
        label = (
            f"CPU, {args.ranks} processes on one host: agree_shm on a shared-memory board, agree_host on "
            "gloo over loopback TCP (a CPU figure, not a GPU one)"
        )
    report = {
        "benchmark": "data-parallel key agreement per step",
        "device": name,
        "label": label,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
        "command": " ".join(["python", *map(shlex.quote, sys.argv)]),
        "ranks": args.ranks,
        "iters": args.iters,
        "exit_codes": codes,
        "per_rank": per_rank,
        "agree_median_us": {
            way: max(r[f"agree_{way}"]["median_us"] for r in per_rank)
            for way in ("shm", "device", "host")
            if f"agree_{way}" in per_rank[0]
        },
        "wrong_answers": sum(
            r[f"agree_{w}"]["wrong_answers"]
            for r in per_rank
            for w in ("shm", "device", "host")
            if f"agree_{w}" in r
        ),
        "target_us": 50,
    }
    default = Path(os.environ["OUT"], "dp-agree.json") if os.environ.get("OUT") else None
    target = (
        Path(args.out) if args.out else default or Path(__file__).parent / "results" / f"{tag}-dp-agree.json"
    )
    target.write_text(json.dumps(report, indent=1) + "\n")
    medians = ", ".join(f"{way} {us:.1f} us" for way, us in report["agree_median_us"].items())
    print(
        f"agree(): median per step (slowest rank): {medians}; wrong answers {report['wrong_answers']}; "
        f"wrote {target}"
    )
    return 0 if all(c == 0 for c in codes) and report["wrong_answers"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
