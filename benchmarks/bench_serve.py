"""End-to-end serving benchmark: ``devgraph serve`` per ``--device-graph-mode``, one process each, same trace.

``--gpu`` (the recorded run, about 5 minutes on an H100): Qwen3-0.6B's shape, bf16, 32 running
requests, a 2048-token step budget. For each mode (``auto``, ``disabled``) a server starts as a
subprocess, takes a few warm-up requests, then two seeded traces over real HTTP (streaming, greedy):
16 requests at concurrency 1 and 64 at concurrency 32, prompts of 32-256 random token ids, 64-128
output tokens. It reports TTFT, inter-token latency and output tokens/s (p50/p90/p99), the engine and
runner statistics, and whether every request's greedy output is identical across modes. The same pair
then runs with ``--deterministic`` (one fixed step shape per phase, no mixed steps), where identity
does not depend on how the requests happened to be batched. Each server gets SIGTERM at the end and
must exit 0.

Writes ``$OUT/serve.json`` and ``$OUT/serve.png`` (``benchmarks/results/`` when ``OUT`` is unset).
``--smoke`` runs the same script on the CPU with the tiny preset in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from devgraph.serve.bench.loadgen import make_trace, run_load
from devgraph.serve.bench.report import plot_modes, summary_table

ROOT = Path(__file__).resolve().parent.parent

GPU: dict[str, Any] = {
    "server": [
        "--preset", "qwen3-0.6b", "--dtype", "bf16", "--device", "cuda",
        "--max-running-requests", "32", "--token-budget", "2048",
    ],
    "scenarios": {"c1": (1, 16, 1), "c32": (32, 64, 0)},  # name: (concurrency, requests, trace seed)
    "deterministic_scenarios": ("c1", "c32"),
    "prompt_len": (32, 256),
    "output_len": (64, 128),
    "warmup": 12,
    "start_timeout": 600.0,
}  # fmt: skip
SMOKE: dict[str, Any] = {
    "server": ["--preset", "tiny", "--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "8"],
    "scenarios": {"c1": (1, 3, 1), "c8": (8, 10, 0)},
    "deterministic_scenarios": ("c1", "c8"),
    "prompt_len": (8, 40),
    "output_len": (4, 12),
    "warmup": 2,
    "start_timeout": 300.0,
}


class Server:
    """``python -m devgraph.serve`` as a subprocess on a free port; its stderr goes to ``log``."""

    def __init__(self, args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
        self.command = [sys.executable, "-m", "devgraph.serve", *args, "--port", "0", "--host", "127.0.0.1"]
        self.log = log
        self.timeout = timeout
        self.env = None if env is None else {**os.environ, **env}
        self.url = ""
        self.startup_seconds = 0.0

    def __enter__(self) -> Server:
        start = time.perf_counter()
        self._err = open(self.log, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=ROOT, env=self.env
        )
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if "listening on" in line and not found:
                    found.append(line.rsplit(" ", 1)[-1].strip())

        threading.Thread(target=read, daemon=True).start()
        while not found:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log}")
            if time.perf_counter() - start > self.timeout:
                self.proc.kill()
                raise RuntimeError(f"server did not start in {self.timeout:.0f} s; see {self.log}")
            time.sleep(0.1)
        self.url = found[0]
        self.startup_seconds = time.perf_counter() - start
        return self

    def wait_graphs(self) -> float:
        """Seconds from the server's start until /health says every graph is captured (the server captures
        them in the background by default: a measurement taken before would time eager steps)."""
        start = time.perf_counter()
        while True:
            graphs = self.get("/health").get("graphs")
            if graphs is None or graphs["ready"] or graphs["error"]:
                return self.startup_seconds + time.perf_counter() - start
            if time.perf_counter() - start > self.timeout:
                raise RuntimeError(f"graphs not captured in {self.timeout:.0f} s: {graphs}; see {self.log}")
            time.sleep(0.05)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return json.loads(response.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def _trace(settings: dict[str, Any], card: dict[str, Any], count: int, seed: int) -> list[Any]:
    return make_trace(
        count, settings["prompt_len"], settings["output_len"], card["vocab_size"], card["max_seq_len"], seed
    )


def run_mode(
    settings: dict[str, Any], extra: list[str], mode: str, scenarios: tuple[str, ...], out: Path
) -> dict:
    args = [*settings["server"], *extra, "--device-graph-mode", mode]
    label = "-".join([mode, *(a.lstrip("-") for a in extra)])
    record: dict[str, Any] = {"server_command": shlex.join(["python", "-m", "devgraph.serve", *args])}
    with Server(args, out / f"serve-{label}.log", settings["start_timeout"]) as server:
        record["startup_seconds"] = server.startup_seconds
        record["graphs_ready_seconds"] = server.wait_graphs()
        card = server.get("/v1/models")["data"][0]
        warm = _trace(settings, card, settings["warmup"], 99)
        asyncio.run(run_load(server.url, warm, concurrency=len(warm), progress=False, model=card["id"]))
        asyncio.run(run_load(server.url, warm[:2], concurrency=1, progress=False, model=card["id"]))
        record["scenarios"], record["outputs"] = {}, {}
        for name in scenarios:
            concurrency, count, seed = settings["scenarios"][name]
            run = asyncio.run(
                run_load(
                    server.url, _trace(settings, card, count, seed), concurrency=concurrency, model=card["id"]
                )
            )
            print(f"[{label}] {name}:\n{summary_table(run['summary'])}", flush=True)
            record["scenarios"][name] = run["summary"]
            # Token ids as one string per request ("12 7 431 ..."): the JSON stays readable and small.
            record["outputs"][name] = [
                " ".join(map(str, r["token_ids"])) if r["ok"] else None for r in run["results"]
            ]
            record.setdefault("errors", []).extend(r["error"] for r in run["results"] if r["error"])
        record["engine_stats"] = server.get("/v1/engine/stats")
        record["exit_code"] = server.stop()
    print(
        f"[{label}] started in {record['startup_seconds']:.1f} s, exit code {record['exit_code']}", flush=True
    )
    return record


def compare(a: dict, b: dict) -> dict[str, Any]:
    """Per scenario: how many requests have identical token ids in both runs, and where others diverge."""
    report = {}
    for name in a["outputs"]:
        pairs = list(zip(a["outputs"][name], b["outputs"][name], strict=True))
        diverged = []
        for index, (x, y) in enumerate(pairs):
            if x is None or y is None or x != y:
                xs, ys = (x or "").split(), (y or "").split()  # token ids, one string per request
                first = next((i for i, (p, q) in enumerate(zip(xs, ys, strict=False)) if p != q), None)
                diverged.append({"request": index, "first_different_token": first})
        report[name] = {"requests": len(pairs), "identical": len(pairs) - len(diverged), "diverged": diverged}
    return report


def targets(group: dict[str, Any]) -> dict[str, Any]:
    """The issue's four targets for one group (a server configuration run in both modes)."""
    auto, eager = group["modes"]["auto"]["scenarios"], group["modes"]["disabled"]["scenarios"]
    low, high = min(auto, key=_concurrency), max(auto, key=_concurrency)
    itl = eager[low]["itl_ms"]["p50"] / auto[low]["itl_ms"]["p50"]
    tps = auto[high]["output_tokens_per_s"] / eager[high]["output_tokens_per_s"]
    identity = group["identity"]
    return {
        "greedy_identical_every_request": {
            "met": all(v["identical"] == v["requests"] for v in identity.values()),
            "per_scenario": {k: f"{v['identical']}/{v['requests']}" for k, v in identity.items()},
        },
        f"itl_p50_{low}_disabled_over_auto": {"value": itl, "target": 4.0, "met": itl >= 4.0},
        f"output_tps_{high}_auto_over_disabled": {"value": tps, "target": 2.0, "met": tps >= 2.0},
        **{
            f"ttft_p50_{name}_auto_ms_le_disabled": {
                "auto": auto[name]["ttft_ms"]["p50"],
                "disabled": eager[name]["ttft_ms"]["p50"],
                "met": auto[name]["ttft_ms"]["p50"] <= eager[name]["ttft_ms"]["p50"],
            }
            for name in auto
        },
    }


def _concurrency(name: str) -> int:
    return int("".join(c for c in name if c.isdigit()))


def _meta(command: list[str]) -> dict[str, Any]:
    import aiohttp
    import torch

    meta: dict[str, Any] = {
        "command": shlex.join(command),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "aiohttp": aiohttp.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpu", action="store_true", help="the recorded H100 run")
    which.add_argument("--smoke", action="store_true", help="the same script on the CPU, tiny preset")
    parser.add_argument("--out", default=None, help="output folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--no-deterministic", action="store_true", help="skip the --deterministic pair")
    args = parser.parse_args(argv)
    settings = GPU if args.gpu else SMOKE
    out = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    name = "serve" if args.gpu else "serve-smoke"
    result: dict[str, Any] = {"meta": _meta([sys.argv[0], *sys.argv[1:]]), "settings": settings, "groups": {}}
    start = time.perf_counter()
    groups: dict[str, tuple[list[str], tuple[str, ...]]] = {"default": ([], tuple(settings["scenarios"]))}
    if not args.no_deterministic:
        groups["deterministic"] = (["--deterministic"], tuple(settings["deterministic_scenarios"]))
    for group, (extra, scenarios) in groups.items():
        modes = {mode: run_mode(settings, extra, mode, scenarios, out) for mode in ("auto", "disabled")}
        record: dict[str, Any] = {"modes": modes, "identity": compare(modes["auto"], modes["disabled"])}
        print(f"[{group}] identical greedy outputs: {json.dumps(record['identity'])}", flush=True)
        result["groups"][group] = record
    result["targets"] = {group: targets(record) for group, record in result["groups"].items()}
    result["exit_codes_zero"] = all(
        m["exit_code"] == 0 for g in result["groups"].values() for m in g["modes"].values()
    )
    result["seconds"] = time.perf_counter() - start
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    try:
        runs = {
            f"{mode}{'' if group == 'default' else ' --' + group}": record["modes"][mode]["scenarios"]
            for group, record in result["groups"].items()
            for mode in ("auto", "disabled")
        }
        title = f"devgraph serve, {result['meta']['device']}: --device-graph-mode auto vs disabled"
        plot_modes(runs, str(out / f"{name}.png"), title)
    except Exception as exc:  # the JSON is the record; a missing matplotlib only costs the picture
        print(f"no plot: {exc}", file=sys.stderr)
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {out / (name + '.json')} in {result['seconds']:.0f} s")
    return 0 if result["exit_codes_zero"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
