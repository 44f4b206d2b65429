"""What the lock around ``GraphRunner.run()`` costs when one thread uses the runner (the common case).

Measures, in one process: the host time of ``run()`` of a runner with its lock and of a twin built with
``single_thread=True`` (no lock; same forward, sizes and inputs, rounds interleaved), and the raw cost of
entering and leaving an uncontended ``threading.RLock`` (what the runner holds) and ``threading.Lock``.

    python benchmarks/run_lock_cost.py --out benchmarks/results/cpu-run-lock.json          # CPU simulator
    python benchmarks/run_lock_cost.py --device cuda --out $OUT/cuda-run-lock.json         # a GPU

On the CPU a replay re-runs the recorded ops, so ``run()`` costs what eager costs; on a GPU ``run()`` is
the host-side launch only, and the lock's share of it is what matters.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import threading
import time
import timeit
from typing import Any

import torch

from devgraph import GraphRunner, StaticInput


class NoLock:
    """A stand-in for the runner's lock that does nothing."""

    def __enter__(self) -> NoLock:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def build_runner(
    device: str, mode: str, hidden: int, single_thread: bool = False
) -> tuple[GraphRunner, torch.Tensor]:
    weight = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)).to(device) / hidden**0.5

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ weight) + x

    runner = GraphRunner(
        forward,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (hidden,), fill=0.0)},
        device=device,
        mode=mode,
        sizes=[1, 2, 4, 8],
        progress=False,
        single_thread=single_thread,
    )
    runner.capture()
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1)).to(device)
    return runner, x  # 3 rows: a padded step (bucket 4)


def time_runs(runner: GraphRunner, x: torch.Tensor, iters: int, sync: Any) -> float:
    """Mean host seconds per ``run()`` (the device is synchronized before the loop, not inside it)."""
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        runner.run(x=x)
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / iters


def raw_ns(statement: str, lock: Any, number: int) -> float:
    """Best-of-5 nanoseconds per ``statement`` (a ``with lock: pass``, or ``pass`` for the loop itself)."""
    return min(timeit.repeat(statement, number=number, repeat=5, globals={"lock": lock})) / number * 1e9


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default="full")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2000, help="run() calls per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per variant, interleaved")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)

    runner, x = build_runner(args.device, args.mode, args.hidden)
    lone, _ = build_runner(args.device, args.mode, args.hidden, single_thread=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for _ in range(200):  # warm up both
        runner.run(x=x)
        lone.run(x=x)
    with_lock: list[float] = []
    without_lock: list[float] = []
    for _ in range(args.rounds):
        with_lock.append(time_runs(runner, x, args.iters, sync))
        without_lock.append(time_runs(lone, x, args.iters, sync))
    bucket = runner.bucket(int(x.shape[0]))
    runner.close()
    lone.close()

    locked_us = statistics.median(with_lock) * 1e6
    unlocked_us = statistics.median(without_lock) * 1e6
    result = {
        "what": "GraphRunner.run() host time with its lock vs a single_thread=True twin, one thread",
        "command": " ".join(["python", *map(shlex.quote, sys.argv)]),
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "mode": args.mode,
        "step": {"rows": int(x.shape[0]), "bucket": bucket, "hidden": args.hidden},
        "iters_per_round": args.iters,
        "rounds": args.rounds,
        "run_us_with_lock_median": round(locked_us, 3),
        "run_us_without_lock_median": round(unlocked_us, 3),
        "lock_share_us": round(locked_us - unlocked_us, 3),
        "lock_share_percent": round(100 * (locked_us - unlocked_us) / unlocked_us, 2),
        "run_us_with_lock_rounds": [round(v * 1e6, 3) for v in with_lock],
        "run_us_without_lock_rounds": [round(v * 1e6, 3) for v in without_lock],
        "run_us_round_stdev_with_lock": round(statistics.stdev(with_lock) * 1e6, 3),
        "run_us_round_stdev_without_lock": round(statistics.stdev(without_lock) * 1e6, 3),
        "raw_ns_with_rlock_pass": round(raw_ns("with lock: pass", threading.RLock(), 500_000), 1),
        "raw_ns_with_lock_pass": round(raw_ns("with lock: pass", threading.Lock(), 500_000), 1),
        "raw_ns_with_nolock_pass": round(raw_ns("with lock: pass", NoLock(), 500_000), 1),
        "raw_ns_empty_statement": round(raw_ns("pass", None, 500_000), 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
