"""``devgraph serve --tp 2`` against one device on two checkpoints: where tensor parallelism cannot pay and
where it must.

    python benchmarks/serve_tp_check.py --out $OUT/serve-tp.json          # 2 GPUs of one host, ~6 min
    python benchmarks/serve_tp_check.py --smoke --out /tmp/serve-tp.json  # the CPU (gloo), tiny shapes

Sections, in order; each asks the time budget (``--time-budget``, 400 s on GPUs) first, and what does not
fit is recorded under ``skipped``:

1. Per checkpoint of the plan (``serve_tp/plan.py``): ``small`` (Llama, hidden 1024, 8 layers, bf16) and
   ``8b`` (Llama-3-8B's shape, 16 GB of random bf16 weights), each written to a temporary folder by
   ``tests/checkpoints.py:write_random_checkpoint`` (drawn on the GPU, streamed shard by shard). Then the
   one-device server and the ``--tp 2`` server, each its own process with its step timeline on
   (``DEVGRAPH_STEP_TIMELINE``: CUDA events around every step's device work): start-up (the weights' load
   seconds from the server's own stages), greedy tokens of a few prompts sent together (one device against
   ``--tp 2``: bf16 rounding makes them part after a while), then the load phases (streamed requests at
   concurrency 1, 32, 64: ITL, TTFT, tokens/s from the client; a decode step's device time and the
   device's idle time between steps from the timeline).
2. The bandwidth floor of the 8B decode step at batch 1: its weight bytes over the card's spec bandwidth
   and over a measured 1 GiB device-to-device copy.
3. Float32 greedy agreement on the small checkpoint, one device against ``--tp 2``; then a worker of that
   ``--tp 2`` server is killed (SIGKILL) while a long request streams: the seconds to the request's error
   and to the server's exit, its exit code and last log lines.

JSON (device, torch, NCCL, the command, every figure, the targets) to ``--out``, a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the checkpoint writer and the server process of the tests

from checkpoints import write_random_checkpoint  # noqa: E402
from serve_tp.analysis import bandwidth_floor, targets  # noqa: E402
from serve_tp.plan import GPU, SMOKE, Model, Plan  # noqa: E402
from serve_tp.plot import plot  # noqa: E402
from serve_tp.runs import Served, kill_a_worker, prompts_for, start  # noqa: E402

from devgraph.serve.checkpoint.source import TP_COMM_ENV  # noqa: E402


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.began = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.began)


def _versions() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["device"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["device"] = "cpu"
    return info


def _compare(expected: list[Any], got: list[Any]) -> dict[str, Any]:
    """Per prompt: equal, or the first position where the tokens part."""
    first: list[int | None] = []
    for a, b in zip(expected, got, strict=True):
        if a is None or b is None:
            first.append(-1)
            continue
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        first.append(diff if diff is not None or len(a) == len(b) else min(len(a), len(b)))
    return {"equal": sum(d is None for d in first), "prompts": len(first), "first_difference": first}


def _weights(served: Served, checkpoint: dict[str, Any], ranks: int) -> dict[str, Any]:
    """The load stage of the server's start-up: seconds, and GB/s of what each rank read."""
    seconds = served.record["startup"].get("weights_s")
    per_rank = checkpoint["bytes"] / ranks
    return {
        "seconds": seconds,
        "bytes_per_rank": int(per_rank),
        "GBps_per_rank": round(per_rank / seconds / 1e9, 2) if seconds else None,
        "note": "rank 0's figure; the checkpoint was just written, so it is read from the page cache",
    }


def _serve_model(
    model: Model, plan: Plan, work: Path, budget: Budget, data: dict[str, Any], flags: list[str]
) -> None:
    directory = work / model.name
    drawn_on = "cuda" if plan.device == "cuda" else "cpu"
    checkpoint = write_random_checkpoint(directory, "llama", device=drawn_on, words=True, **model.shape)
    checkpoint["directory"] = f"<a temporary folder>/{model.name}"
    data["checkpoints"][model.name] = checkpoint
    print(
        f"{model.name}: {checkpoint['bytes'] / 1e9:.2f} GB written in {checkpoint['seconds']} s", flush=True
    )
    vocab = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    prompts = prompts_for(model.prompts, (8, 48), vocab, seed=7)
    tokens: dict[int, list[Any]] = {}
    for ranks in (1, 2):
        label = f"{model.name}_tp{ranks}"
        if budget.left() < model.start_s:
            data["skipped"].append(f"{label}: {budget.left():.0f} s of the budget left")
            continue
        extra = ["--dtype", "bfloat16", *flags] + (["--tp", "2"] if ranks == 2 else [])
        try:
            served = start(label, directory, model, plan.device, extra, work, budget.left())
        except Exception as exc:  # recorded: a server that does not start is the finding
            data["servers"][label] = {"error": repr(exc)[-3000:]}
            continue
        data["servers"][label] = served.record
        try:
            served.record["weights"] = _weights(served, checkpoint, ranks)
            tokens[ranks] = served.greedy(prompts, model.new_tokens)
            served.run_loads(model, vocab)
        except Exception as exc:
            served.record["error"] = repr(exc)[-3000:]
        served.stop()
        if ranks == 2:  # how the ranks all-reduced (DEVGRAPH_TP_COMM), and any fallback the comm logged
            served.record["tp_comm"] = os.environ.get(TP_COMM_ENV, "auto")
            served.record["tp_fuse"] = os.environ.get("DEVGRAPH_TP_FUSE", "1 (default)")
            served.record["tp_comm_log"] = [
                line.rstrip()[-400:]
                for line in served.server.stderr
                if "symm" in line.lower() or "fused all-reduce" in line.lower()
            ][-4:]
        failed = any(load.get("failed") for load in served.record.get("loads", {}).values())
        if failed or served.record.get("exit_code") not in (0, None) or "error" in served.record:
            # What the server and its ranks said last (a rank's crash: PYTHONFAULTHANDLER=1 adds its stacks).
            served.record["stderr_tail"] = [line.rstrip()[-300:] for line in served.server.stderr][-120:]
        _print_server(label, served.record)
    if len(tokens) == 2:
        data["servers"][f"{model.name}_tp2"]["tokens_vs_one_device_bf16"] = _compare(tokens[1], tokens[2])


def _fp32_and_kill(plan: Plan, work: Path, budget: Budget, data: dict[str, Any]) -> None:
    model = plan.models[0]
    directory = work / model.name
    vocab = int(json.loads((directory / "config.json").read_text())["vocab_size"])
    prompts = prompts_for(model.prompts, (8, 48), vocab, seed=7)
    tokens: dict[int, list[Any]] = {}
    for ranks in (1, 2) if plan.fp32_check else (2,):
        label = f"{model.name}_tp{ranks}_fp32"
        if budget.left() < model.start_s:
            data["skipped"].append(f"{label}: {budget.left():.0f} s of the budget left")
            continue
        extra = ["--dtype", "float32", "--deterministic"] + (["--tp", "2"] if ranks == 2 else [])
        try:
            served = start(label, directory, model, plan.device, extra, work, budget.left())
        except Exception as exc:
            data["servers"][label] = {"error": repr(exc)[-3000:]}
            continue
        data["servers"][label] = served.record
        try:
            tokens[ranks] = served.greedy(prompts, model.new_tokens)
        except Exception as exc:
            served.record["error"] = repr(exc)[-3000:]
        if ranks == 2:
            context = int(json.loads((directory / "config.json").read_text())["max_position_embeddings"])
            data["kill_a_worker"] = kill_a_worker(served.server, min(context, 1024) - 8)
        else:
            served.stop()
    if len(tokens) == 2:
        data["servers"][f"{model.name}_tp2_fp32"]["tokens_vs_one_device"] = _compare(tokens[1], tokens[2])


def run(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    budget = Budget(args.time_budget or plan.time_budget)
    work = Path(tempfile.mkdtemp(prefix="devgraph-tp-check-"))
    data: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        **_versions(),
        "plan": {
            m.name: {"shape": m.shape, "flags": list(m.flags), "loads": [vars(x) for x in m.loads]}
            for m in plan.models
        },
        "checkpoints": {},
        "servers": {},
        "skipped": [],
    }
    try:
        for model in plan.models:
            if args.models and model.name not in args.models.split(","):
                data["skipped"].append(f"{model.name}: not in --models")
                continue
            if budget.left() < 2 * model.start_s:
                data["skipped"].append(f"{model.name}: {budget.left():.0f} s of the budget left")
                continue
            _serve_model(model, plan, work, budget, data, shlex.split(args.serve_flags or ""))
            if model.name == "8b":
                if plan.device == "cuda":
                    data["floor"] = bandwidth_floor(data["checkpoints"]["8b"]["bytes"])
                shutil.rmtree(work / model.name, ignore_errors=True)  # 16 GB of disk back
        if args.no_fp32:
            data["skipped"].append("float32 agreement and the killed worker: --no-fp32")
        else:
            _fp32_and_kill(plan, work, budget, data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data["targets"] = targets(data)
    data["total_s"] = round(time.monotonic() - budget.began, 1)
    return data


def _split(decode: dict[str, Any]) -> str:
    """A decode forward's issue and its parts' medians (ms): before its run, the run, after it (medians:
    they need not add up)."""
    parts = [decode.get(k, {}).get("p50") for k in ("issue_ms", "before_run_ms", "run_ms", "after_run_ms")]
    return "{}; before run / run / after {} / {} / {}; CPU {}, waiting {}".format(
        *parts, decode.get("cpu_ms", {}).get("p50"), decode.get("waiting_share")
    )


def _print_server(label: str, record: dict[str, Any]) -> None:
    loads = record.get("loads", {})
    parts = [
        f"{label}: up in {record.get('listening_s')} s, weights {record.get('weights', {}).get('seconds')} s"
    ]
    for name, load in loads.items():
        timeline = (
            record.get("timeline", {}).get(name, {}) if isinstance(record.get("timeline"), dict) else {}
        )
        parts.append(
            f"{name}: ITL (TPOT p50) {load.get('tpot_ms', {}).get('p50', float('nan')):.3f} ms, "
            f"{load.get('output_tokens_per_s', 0):.0f} tok/s, decode step on device "
            f"{timeline.get('decode_device_ms', {}).get('p50')} ms, idle {timeline.get('idle_share')}"
        )
        host = record.get("hosts", {}).get(name, {})
        if host:
            worker = host.get("worker", {})
            parts.append(
                f"  host: issue p50/p90 {host['issue_ms'].get('p50')}/{host['issue_ms'].get('p90')} ms "
                f"(decode: {_split(host.get('decode', {}))}), "
                f"cadence p50/p90 {host['cadence_ms'].get('p50')}/{host['cadence_ms'].get('p90')} ms"
                + (
                    f"; worker lag p50/p90 {worker['lag_ms'].get('p50')}/{worker['lag_ms'].get('p90')} ms, "
                    f"issue p50 {worker['issue_ms'].get('p50')} ms, "
                    f"behind p50 {worker['behind_ms'].get('p50')} ms"
                    if worker.get("steps_matched")
                    else ""
                )
            )
    print("\n    ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON path (a PNG is written beside it)")
    parser.add_argument("--smoke", action="store_true", help="the CPU (gloo), tiny shapes: checks the script")
    parser.add_argument("--time-budget", type=float, help="seconds (default 400 on GPUs, 600 for --smoke)")
    parser.add_argument(
        "--tp-comm",
        help=f"the --tp servers' all-reduce ({TP_COMM_ENV}: auto, torch, op or symm; default: the server's)",
    )
    parser.add_argument("--models", help="comma list of the plan's models to serve (default: all)")
    parser.add_argument(
        "--serve-flags", help='more flags for every bfloat16 server, one string ("--switch-interval-us 5000")'
    )
    parser.add_argument(
        "--no-fp32",
        action="store_true",
        help="skip section 3 (float32 agreement, the killed worker: tests/test_serve_tp.py has the latter "
        "as a multi_gpu test)",
    )
    args = parser.parse_args(argv)
    if args.tp_comm:
        os.environ[TP_COMM_ENV] = args.tp_comm  # the servers inherit it; every rank reads it
    plan = SMOKE if args.smoke else GPU
    if plan.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, {torch.cuda.device_count()} visible (use --smoke on the CPU)", file=sys.stderr)
        return 2
    data = run(args, plan)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    plot(data, out.with_suffix(".png"))
    for row in data["targets"]:
        verdict = "MET " if row["met"] else "MISS" if row["met"] is False else "----"
        print(f"{verdict} {row['what']}: {row['value']} ({row['bound']})")
    print(
        json.dumps(
            {k: data[k] for k in ("skipped", "kill_a_worker", "floor", "total_s") if k in data}, indent=1
        )[:3000]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
