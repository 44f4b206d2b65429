"""Can a CUDA graph be captured while another thread runs eager work? The evidence behind background
capture's rule (a capture never overlaps a step; docs/user-guide.md, "Serving before the graphs are ready").

    python benchmarks/concurrent_capture_probe.py --out $OUT/concurrent_capture.json   # GPU, about 1 min

Each case runs in a fresh process: the main thread captures a 16-layer MLP step into a graph ``--captures``
times (``torch.cuda.graph`` with the case's ``capture_error_mode``, on a side stream, a shared pool) while a
second thread loops an engine's eager work on the default stream: a fresh allocation of a varying size (the
caching allocator), a matmul, a sampled value read back with ``.item()`` (a synchronizing copy). Cases:
``global`` (torch's default), ``thread_local`` (devgraph's), ``relaxed``, and ``serialized`` (thread_local
with one lock around each capture and each eager iteration, as devgraph's BackgroundCapture does). Reported
per case: captures that failed, eager iterations that failed (first error of each kind), replays whose
output differs from eager, and whether the process survived. No timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

CASES = ("global", "thread_local", "relaxed", "serialized")


def child(case: str, captures: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    weights = [torch.randn(1024, 1024, device="cuda") / 32 for _ in range(16)]
    x = torch.randn(64, 1024, device="cuda")

    def forward() -> torch.Tensor:
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        return h

    expected = forward().clone()
    mode = "thread_local" if case == "serialized" else case
    lock = threading.Lock() if case == "serialized" else None
    stop = threading.Event()
    eager_errors: Counter[str] = Counter()
    eager_done = [0]

    def eager() -> None:
        size = 1
        while not stop.is_set():
            with lock if lock is not None else contextlib.nullcontext():
                try:
                    size = size % 4093 + 97
                    a = torch.randn(size, 256, device="cuda")
                    (a @ a.T).sum().item()
                    eager_done[0] += 1
                except Exception as exc:
                    eager_errors[f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"] += 1
            time.sleep(0)

    worker = threading.Thread(target=eager, daemon=True)
    worker.start()
    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    capture_errors: Counter[str] = Counter()
    wrong = captured = 0
    for _ in range(captures):
        with lock if lock is not None else contextlib.nullcontext():
            graph = torch.cuda.CUDAGraph()
            try:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    forward()  # warm-up on the capture stream
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                    out = forward()
                graph.replay()
                torch.cuda.synchronize()
                captured += 1
                wrong += int(not torch.equal(out, expected))
            except Exception as exc:
                capture_errors[f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"] += 1
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
        time.sleep(0)
    stop.set()
    worker.join(30)
    return {
        "case": case,
        "capture_error_mode": mode,
        "captures": captures,
        "captured": captured,
        "capture_errors": dict(capture_errors),
        "replays_wrong": wrong,
        "eager_iterations": eager_done[0],
        "eager_errors": dict(eager_errors),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/concurrent_capture.json")
    parser.add_argument("--captures", type=int, default=50)
    parser.add_argument("--time-budget", type=float, default=240.0, help="seconds for all cases")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.captures)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: this probe is about CUDA", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join([sys.executable, *sys.argv]),
        "cases": {},
    }
    per_case = args.time_budget / len(CASES)
    for case in CASES:
        command = [sys.executable, __file__, "--child", case, "--captures", str(args.captures)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=per_case)
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            result = json.loads(last) if last.startswith("{") else {}
            result.update(
                exit_code=done.returncode, stderr_tail=done.stderr[-1500:] if done.returncode else ""
            )
        except subprocess.TimeoutExpired:
            result = {"case": case, "exit_code": None, "note": f"did not finish in {per_case:.0f} s (a hang)"}
        results["cases"][case] = result
        print(json.dumps(result), flush=True)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
