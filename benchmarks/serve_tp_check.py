"""``devgraph serve --tp 2`` against the single-device server on one checkpoint: tokens, speed, a lost rank.

    python benchmarks/serve_tp_check.py --out $OUT/serve-tp.json          # 2 GPUs, bf16, <= 4 min
    python benchmarks/serve_tp_check.py --smoke --out /tmp/serve-tp.json  # the CPU, gloo, tiny shape

1. A Llama checkpoint written by ``tests/checkpoints.py`` (random weights, untied head) in a temporary
   folder: hidden 1024, 8 layers, 16 query / 8 KV heads, vocab 32000 (``--smoke``: its tiny test shape).
2. Per dtype (bfloat16, then float32 for an agreement that does not hang on bf16 rounding), the
   single-device server, then the ``--tp 2`` server, each its own process with ``--deterministic``: the
   prompts sent together (greedy tokens compared per prompt: equal, or the first differing position), then
   load (bfloat16 only): ``--requests`` streamed requests at concurrency ``--concurrency`` through the
   project's load generator (ITL, TTFT, tokens/s).
3. A worker of the last ``--tp 2`` server is killed (SIGKILL) while a long request streams: the seconds to
   the request's error event and to the server's exit, its exit code and its last log lines.

JSON (device, torch, NCCL, command, per-server results, the kill) to ``--out``, a PNG beside it.
``--time-budget`` (default 240 s) is checked before each server; what does not fit is recorded as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the checkpoint writer and the server process of the tests

from checkpoints import build_checkpoint  # noqa: E402
from servers import ServerProcess  # noqa: E402

from devgraph.serve.bench.loadgen import TraceRequest, run_load  # noqa: E402

GPU_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=2048,
    vocab_size=32000,
)
SERVER_START_S = 60  # what one server's start-up may take, checked against the budget


def _workers(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(c)
        for c in children
        if Path(f"/proc/{c}").exists() and b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def _prompts(count: int, vocab: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)  # ids 3..399: the test tokenizer's range (any id < vocab_size is valid)
    return [[rng.randrange(3, min(vocab, 400)) for _ in range(rng.randint(8, 48))] for _ in range(count)]


def _load(url: str, trace: list[TraceRequest], concurrency: int) -> dict[str, Any]:
    return asyncio.run(run_load(url, trace, concurrency=concurrency, progress=False, timeout=120))


def _compare(expected: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    first = []
    for a, b in zip(expected, got, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        first.append(diff if diff is not None or len(a) == len(b) else min(len(a), len(b)))
    return {"equal": sum(d is None for d in first), "prompts": len(first), "first_difference": first}


def _kill_worker(server: ServerProcess, max_tokens: int) -> dict[str, Any]:
    """SIGKILL a worker while a long request streams; when the error came and when the server exited."""
    import urllib.request

    (worker,) = _workers(server.proc.pid)
    payload = {
        "prompt": [5, 6, 7],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    body = json.dumps(payload)
    request = urllib.request.Request(server.url + "/v1/completions", data=body.encode(), method="POST")
    result: dict[str, Any] = {"worker_pid": worker, "tokens_before_error": 0}
    killed = time.monotonic()
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result["error_after_s"] = round(time.monotonic() - killed, 3)
                result["error"] = event["error"]["message"][:300]
                break
            result["tokens_before_error"] += 1
            if result["tokens_before_error"] == 5:
                killed = time.monotonic()
                os.kill(worker, signal.SIGKILL)
    try:
        result["exit_code"] = server.proc.wait(timeout=120)
        result["exit_after_s"] = round(time.monotonic() - killed, 3)
    except Exception as exc:  # recorded: a server that did not exit is the finding
        result["exit_code"] = None
        result["not_exited"] = repr(exc)
    result["log_tail"] = [line.rstrip() for line in server.stderr if "tensor-parallel" in line][-4:]
    return result


def _versions() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["device"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["device"] = "cpu"
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    left = lambda: args.time_budget - (time.monotonic() - began)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="devgraph-tp-check-"))
    shape = {} if args.smoke else GPU_SHAPE
    start = time.monotonic()
    directory = build_checkpoint(work / "llama", "llama", **shape)
    vocab = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    data: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        **_versions(),
        "checkpoint": {
            "shape": shape or "tests/checkpoints.py SHAPE",
            "seconds": round(time.monotonic() - start, 1),
        },
        "servers": {},
        "skipped": [],
    }
    device = ["--device", "cpu", "--cpu-threads", "1"] if args.smoke else ["--device", "cuda"]
    limits = [
        "--max-running-requests",
        str(args.concurrency),
        "--token-budget",
        "256" if not args.smoke else "32",
    ]
    prompts = _prompts(args.prompts, vocab)
    rng = random.Random(11)
    trace = [
        TraceRequest(i, [rng.randrange(3, 400) for _ in range(rng.randint(16, 128))], args.new_tokens)
        for i in range(args.requests)
    ]
    last_tp: ServerProcess | None = None
    for dtype in args.dtypes.split(","):
        tokens: dict[str, list[list[int]]] = {}
        for name, extra in (("single", []), ("tp2", ["--tp", "2"])):
            label = f"{name}_{dtype}"
            if left() < SERVER_START_S:
                data["skipped"].append(f"{label}: {left():.0f} s of the budget left")
                continue
            flags = ["--model", str(directory), *device, *limits, "--deterministic", "--dtype", dtype, *extra]
            entry: dict[str, Any] = {"flags": flags}
            data["servers"][label] = entry
            try:
                server = ServerProcess(*flags, "--log-level", "warning")
            except Exception as exc:  # recorded: a server that does not start is the finding
                entry["error"] = repr(exc)[-2000:]
                continue
            try:
                trace_prompts = [TraceRequest(i, p, args.new_tokens) for i, p in enumerate(prompts)]
                greedy = _load(server.url, trace_prompts, len(prompts))
                tokens[name] = [r["token_ids"] for r in greedy["results"]]
                entry["greedy_failed"] = greedy["summary"]["failed"]
                if dtype == "bfloat16" and left() > 30:
                    load = _load(server.url, trace, args.concurrency)["summary"]
                    entry["load"] = {k: v for k, v in load.items() if not isinstance(v, list)}
                    entry["load"]["concurrency"] = args.concurrency
            except Exception as exc:
                entry["error"] = repr(exc)[-2000:]
            if name == "tp2" and "error" not in entry:
                if last_tp is not None:
                    last_tp.stop()
                last_tp = server
            else:
                entry["exit_code"] = server.stop()
        if len(tokens) == 2:
            data["servers"][f"tp2_{dtype}"]["tokens_vs_single"] = _compare(tokens["single"], tokens["tp2"])
    if last_tp is not None:
        context = int(json.loads((directory / "config.json").read_text())["max_position_embeddings"])
        data["kill_a_worker"] = _kill_worker(last_tp, context - 8)
    data["total_s"] = round(time.monotonic() - began, 1)
    return data


def _plot(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = {k: v["load"] for k, v in data["servers"].items() if "load" in v}
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].bar(list(rows), [r["itl_ms"]["p50"] for r in rows.values()])
    axes[0].set_title("ITL p50 (ms)")
    axes[1].bar(list(rows), [r["output_tokens_per_s"] for r in rows.values()])
    axes[1].set_title("output tokens/s")
    fig.suptitle(f"serve --tp 2 vs one device ({data['device']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON path (a PNG is written beside it)")
    parser.add_argument("--smoke", action="store_true", help="the CPU (gloo), the tests' tiny checkpoint")
    parser.add_argument("--time-budget", type=float, default=240.0, help="seconds (default 240)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated (default bf16, fp32)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.new_tokens = min(args.requests, 8), 4, min(args.new_tokens, 16)
    data = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    _plot(data, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in data.items() if k != "servers"}, indent=2)[:3000])
    for label, entry in data["servers"].items():
        print(
            label,
            entry.get("tokens_vs_single", ""),
            {k: entry.get("load", {}).get(k) for k in ("output_tokens_per_s",)},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
