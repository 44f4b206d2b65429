"""What ``GraphRunner.submit()`` buys an engine that overlaps its host work with the device.

A decode-shaped step (``layers`` matmul + tanh blocks, replayed as one ``full`` graph) and a fixed amount
of host work per step (a Python loop standing in for scheduling, detokenization and stop checks), run two
ways over the same inputs, rounds interleaved:

* ``serial``: ``run()``, copy the step's output to the host (which waits for the device), then the host
  work: the device idles while the host works, and the host waits while the device works;
* ``overlapped``: ``submit()``, the output copied into pinned memory with a non-blocking copy and an event
  after it, the host work of the step while the device runs it, then ``wait()`` on that event.

It records the median step time of each and the host work's own time, and checks that both ways produced
the same outputs (bitwise: the same graph replays). On a GPU, overlapped steps should take about
``max(device, host)`` against serial's ``device + host``; on the CPU simulator (``--smoke``) nothing
overlaps and the two are equal, which checks the script only.

    python benchmarks/bench_submit.py                     # GPU: $OUT/submit.json (else benchmarks/results/)
    python benchmarks/bench_submit.py --smoke             # CPU, simulated graphs: checks the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from harness.device import Device
from harness.report import Report, environment, output_path

from devgraph import GraphRunner, StaticInput


def _model(dev: torch.device, hidden: int, layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = [(torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(dev) for _ in range(layers)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for w in weights:
            x = torch.tanh(x @ w)
        return x.sum(dim=-1, keepdim=True)

    return forward


def _host_work(iterations: int) -> int:
    total = 0
    for i in range(iterations):  # a scheduler's, a detokenizer's Python: no device call
        total += i * i % 7
    return total


def _serial(runner: GraphRunner, x: torch.Tensor, work: int) -> torch.Tensor:
    out = runner.run(x=x).cpu()  # waits for the device
    _host_work(work)
    return out


def _overlapped(runner: GraphRunner, x: torch.Tensor, work: int, pinned: torch.Tensor) -> torch.Tensor:
    handle = runner.submit(x=x)
    pinned.copy_(handle.outputs, non_blocking=True)
    done = runner.platform.record_event()  # after the copy, on the same stream
    _host_work(work)  # while the device runs the step
    done.synchronize()
    return pinned.clone()


def _median_ms(fn: Callable[[], Any], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, simulated graphs (checks the script)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--host-iters", type=int, default=20000, help="host work per step (loop iterations)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", help="JSON path (default $OUT/submit.json, else benchmarks/results/)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU here; use --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    if args.smoke:
        args.batch, args.hidden, args.layers, args.host_iters, args.steps = 4, 64, 2, 2000, 20
    dev = Device("cpu" if args.smoke else "cuda")
    path = output_path("submit.json", "benchmarks/results/h100-submit.json", args.out, args.smoke)
    report = Report(path, environment(dev))
    forward = _model(dev.device, args.hidden, args.layers)
    inputs = {"x": StaticInput(torch.float32, (args.hidden,), fill=0.0)}
    runner = GraphRunner(forward, phase="decode", inputs=inputs, device=dev.device, mode="full",
                         sizes=[args.batch], progress=False)  # fmt: skip
    runner.capture()
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, args.hidden, generator=gen).to(dev.device)
    pinned = torch.empty(args.batch, 1, pin_memory=dev.cuda)
    serial_out = _serial(runner, x, args.host_iters)
    overlapped_out = _overlapped(runner, x, args.host_iters, pinned)
    equal = bool(torch.equal(serial_out, overlapped_out))
    for _ in range(10):  # warm the device clocks and the host loop
        _serial(runner, x, args.host_iters)
    rounds: dict[str, list[float]] = {
        "serial_ms": [],
        "overlapped_ms": [],
        "host_work_ms": [],
        "device_ms": [],
    }
    for _ in range(3):
        rounds["serial_ms"].append(_median_ms(lambda: _serial(runner, x, args.host_iters), args.steps))
        rounds["overlapped_ms"].append(
            _median_ms(lambda: _overlapped(runner, x, args.host_iters, pinned), args.steps)
        )
        rounds["host_work_ms"].append(_median_ms(lambda: _host_work(args.host_iters), args.steps))
        rounds["device_ms"].append(_median_ms(lambda: runner.run(x=x).cpu(), args.steps))
    medians = {name: round(statistics.median(values), 4) for name, values in rounds.items()}
    report.data.update(
        {
            "shape": {"batch": args.batch, "hidden": args.hidden, "layers": args.layers},
            "host_iters": args.host_iters,
            "steps_per_round": args.steps,
            "rounds": rounds,
            "medians": medians,
            "overlapped_over_serial": round(medians["overlapped_ms"] / medians["serial_ms"], 4),
            "outputs_equal": equal,
        }
    )
    report.save()
    runner.close()
    print(f"{path}: {medians}, outputs equal: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
