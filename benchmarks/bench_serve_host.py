"""The server's host cost per output token, by thread: the engine thread and the HTTP event loop.

    python benchmarks/bench_serve_host.py                                   # CPU, tiny preset (~40 s)
    python benchmarks/bench_serve_host.py --device cuda --preset qwen3-0.6b # a GPU

``devgraph serve`` runs in this process (its event loop on the main thread, the engine on its own thread);
a ``devgraph bench serve`` subprocess streams ``--requests`` requests at ``--concurrency``. Measured over
the load phase, after a warm-up load and the graphs captured: each thread's CPU time (the kernel's per-thread
clock) per output token, and the engine thread's time inside its runners' ``run`` (the forward: on the CPU
the model itself, which is the device's work there and is subtracted; on a GPU the host's staging and
replay launch, which is host work and is not). The two threads share one Python interpreter lock, so each
thread's CPU time is what it ran, not what it waited for; end-to-end tokens/s is the client's.

Why it exists: issue 30 asks the GPU never to wait for the host. Where a model's step is short (0.54 ms on
an H200 for an 8-layer, hidden-1024 model) the host's work per step is what the client sees; this is that
number, tracked from one round to the next. On the CPU the forward dominates the wall clock, so tokens/s
moves little when the host's work does: the per-thread figures are the ones to compare.

``--sample`` adds one load phase with both threads' stacks sampled every 0.5 ms (``sampled`` in the JSON:
the share of samples per function, innermost and anywhere on the stack). Samples are wall-clock: a thread
blocked in ``select`` or a lock counts there, so read them beside the CPU figures.

Writes JSON (``--out``; default ``$OUT/serve-host.json``, else ``benchmarks/results/cpu-serve-host.json``):
the command, torch, device, medians over ``--repeats`` load phases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

ENGINE_THREAD = "devgraph-engine"


def _thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


class ForwardClock:
    """The engine thread's seconds inside its runners' ``run`` (wrapped per runner object)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, runner: Any) -> None:
        run = runner.run

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        runner.run = timed


def _load(url: str, args: argparse.Namespace, requests: int, out: Path | None) -> None:
    command = [
        sys.executable, "-m", "devgraph", "bench", "serve", "--url", url,
        "--num-requests", str(requests), "--concurrency", str(args.concurrency),
        "--prompt-len", args.prompt_len, "--output-len", args.output_len,
        "--no-progress", "--seed", "1",
    ]  # fmt: skip
    if out is not None:
        command += ["--json", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def _wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if json.loads(answer.read()).get("graphs", {}).get("ready", True) in (True, None):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server at {url} was not ready within {timeout:g} s")


class Sampler:
    """A sampling profiler of two threads (``--sample``): every ``interval`` seconds the frame each thread
    is in, counted by function (self: the innermost frame of this project or the library, inclusive: any
    frame of the stack). Cheap enough to leave the figures of the run it samples nearly unchanged; its own
    thread takes the interpreter lock briefly at each sample."""

    def __init__(self, threads: dict[str, int], interval: float = 0.0005) -> None:
        self.threads, self.interval = threads, interval
        self.own: dict[str, dict[str, int]] = {name: {} for name in threads}
        self.inclusive: dict[str, dict[str, int]] = {name: {} for name in threads}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frames = sys._current_frames()
            self.samples += 1
            for name, ident in self.threads.items():
                frame = frames.get(ident)
                seen: set[str] = set()
                first = True
                while frame is not None:
                    code = frame.f_code
                    where = f"{Path(code.co_filename).name}:{code.co_name}"
                    if first:
                        self.own[name][where] = self.own[name].get(where, 0) + 1
                        first = False
                    if where not in seen:
                        seen.add(where)
                        self.inclusive[name][where] = self.inclusive[name].get(where, 0) + 1
                    frame = frame.f_back

    def report(self, top: int = 25) -> dict[str, Any]:
        def ranked(counts: dict[str, int]) -> dict[str, float]:
            best = sorted(counts.items(), key=lambda item: -item[1])[:top]
            return {where: round(100 * n / max(self.samples, 1), 1) for where, n in best}

        return {
            "samples": self.samples,
            "percent_of_samples_self": {name: ranked(c) for name, c in self.own.items()},
            "percent_of_samples_inclusive": {name: ranked(c) for name, c in self.inclusive.items()},
        }


def drive(args: argparse.Namespace, url: str, engines: list[Any], report: dict[str, Any]) -> None:
    """In a thread: warm up, then ``--repeats`` measured load phases; stops the server at the end."""
    try:
        _wait_ready(url, 600)
        _load(url, args, args.concurrency, None)  # warm-up: every decode size once, the first-use costs
        clock = ForwardClock()
        engine = engines[-1]
        clock.wrap(engine.decode_runner)
        clock.wrap(engine.prefill_runner)
        threads = {t.name: t.ident for t in threading.enumerate() if t.ident is not None}
        loop, worker = threads["MainThread"], threads[ENGINE_THREAD]
        runs = []
        if args.sample:  # one more load phase, sampled (the measured phases are not)
            with Sampler({"event_loop": loop, "engine": worker}) as sampler:
                _load(url, args, args.requests, None)
            report["sampled"] = sampler.report()
        for repeat in range(args.repeats):
            out = Path(args.work) / f"load-{repeat}.json"
            forward0, loop0, engine0 = clock.seconds, _thread_cpu(loop), _thread_cpu(worker)
            began = time.perf_counter()
            _load(url, args, args.requests, out)
            wall = time.perf_counter() - began
            results = json.loads(out.read_text())["results"]
            tokens = sum(len(r["token_ids"]) for r in results)
            per = 1e6 / max(tokens, 1)
            forward = (clock.seconds - forward0) * per
            engine_cpu = (_thread_cpu(worker) - engine0) * per
            runs.append(
                {
                    "output_tokens": tokens,
                    "wall_s": round(wall, 3),
                    "tokens_per_s": round(tokens / wall, 1),
                    "event_loop_us_per_token": round((_thread_cpu(loop) - loop0) * per, 2),
                    "engine_thread_us_per_token": round(engine_cpu, 2),
                    "engine_forward_us_per_token": round(forward, 2),
                }
            )
        report["runs"] = runs
    except Exception as exc:  # recorded; the server is stopped either way
        report["error"] = repr(exc)
    finally:
        os.kill(os.getpid(), 15)


def summarise(report: dict[str, Any], device: str) -> None:
    runs = report.get("runs") or []
    if not runs:
        return
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    engine_host = median["engine_thread_us_per_token"]
    if device == "cpu":  # the forward is the device's work on a CPU server
        engine_host -= median["engine_forward_us_per_token"]
    report["median"] = {
        **{k: round(v, 2) for k, v in median.items()},
        "engine_host_us_per_token": round(engine_host, 2),
        "host_us_per_token": round(engine_host + median["event_loop_us_per_token"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96, help="per measured load phase")
    parser.add_argument("--repeats", type=int, default=3, help="measured load phases (medians)")
    parser.add_argument("--prompt-len", default="16:64")
    parser.add_argument("--output-len", default="64:96")
    parser.add_argument("--port", type=int, default=18341)
    parser.add_argument("--out")
    parser.add_argument(
        "--sample",
        action="store_true",
        help="sample both threads' stacks in an extra load phase (JSON: sampled)",
    )
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.work = args.work or tempfile.mkdtemp(prefix="bench-serve-host-")
    default = Path(os.environ["OUT"], "serve-host.json") if os.environ.get("OUT") else None
    tag = "cpu" if args.device == "cpu" else "gpu"
    out = (
        Path(args.out)
        if args.out
        else default or Path(__file__).parent / "results" / f"{tag}-serve-host.json"
    )

    from devgraph.serve import engine as engine_module
    from devgraph.serve.cli import serve_main

    engines: list[Any] = []
    original = engine_module.Engine.__init__

    def remember(self: Any, *a: Any, **k: Any) -> None:
        original(self, *a, **k)
        engines.append(self)

    engine_module.Engine.__init__ = remember  # type: ignore[method-assign]
    report: dict[str, Any] = {
        "benchmark": "host cost per output token of devgraph serve, by thread",
        "command": " ".join(["python", *map(shlex.quote, sys.argv)]),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "cpu_count": os.cpu_count(),
        "load_average_before": list(os.getloadavg()),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
    }
    url = f"http://127.0.0.1:{args.port}"
    threading.Thread(target=drive, args=(args, url, engines, report), daemon=True, name="driver").start()
    flags = [
        "--preset", args.preset, "--device", args.device, "--max-running-requests", str(args.concurrency),
        "--port", str(args.port), "--log-stats-interval", "0", "--log-level", "warning", "--no-progress",
    ]  # fmt: skip
    if args.device == "cpu":
        flags += ["--token-budget", "256"]
    with contextlib.suppress(SystemExit):  # the driver ends the server with SIGTERM
        serve_main(flags)
    summarise(report, args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report.get("median", report.get("error")), indent=1))
    print(f"wrote {out}")
    return 0 if "median" in report else 1


if __name__ == "__main__":
    raise SystemExit(main())
