"""One ``devgraph serve --model DIR`` subprocess per configuration, measured from the outside.

Per configuration: seconds until it listens and until its first response (a one-token completion), the
server's own start-up stages (``/v1/engine/stats``: reading the checkpoint, loading the weights, capturing
the graphs, the warm-up), the oracle prompts sent one at a time and then all at once (greedy, every token
kept with ``ignore_eos``), a warm-up trace, then the load scenarios (seeded traces, streaming, through
``devgraph.serve.bench.loadgen``; not for ``plan.oracle_only`` configurations), the engine's statistics,
and the exit code after SIGTERM.
"""

from __future__ import annotations

import asyncio
import shlex
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_serve import Server

from checkpoint_bench.plan import Plan
from devgraph.serve.bench.loadgen import TraceRequest, make_trace, run_load
from devgraph.serve.bench.report import summary_table

__all__ = ["run_config"]


def _tokens(url: str, model: str, prompts: list[list[int]], new_tokens: int, concurrency: int) -> list[Any]:
    trace = [TraceRequest(i, p, new_tokens) for i, p in enumerate(prompts)]
    run = asyncio.run(run_load(url, trace, concurrency=concurrency, progress=False, model=model))
    return [r["token_ids"] if r["ok"] else None for r in run["results"]]


def _first_response(url: str, model: str) -> float:
    body = f'{{"model": "{model}", "prompt": [3, 4, 5], "max_tokens": 1, "temperature": 0}}'.encode()
    start = time.perf_counter()
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - start


def run_config(
    name: str,
    flags: list[str],
    plan: Plan,
    checkpoint: Path,
    prompts: list[list[int]],
    out: Path,
    start_timeout: float,
) -> dict[str, Any]:
    """Run configuration ``name``; a server that has not started within ``start_timeout`` seconds is
    killed (the caller passes what the time budget has left)."""
    args = ["--model", str(checkpoint), *plan.server, *flags]
    record: dict[str, Any] = {"server_command": shlex.join(["python", "-m", "devgraph.serve", *args])}
    with Server(args, out / f"serve-checkpoint-{name}.log", start_timeout) as server:
        card = server.get("/v1/models")["data"][0]
        model = card["id"]
        first = _first_response(server.url, model)
        record["startup"] = {
            "listening_s": round(server.startup_seconds, 2),
            "first_response_s": round(server.startup_seconds + first, 2),
            "graphs_ready_s": round(server.wait_graphs(), 2),  # captured in the background by default
            "server_stages": server.get("/v1/engine/stats")["startup"],
        }
        record["oracle_alone"] = _tokens(server.url, model, prompts, plan.new_tokens, 1)
        record["oracle_loaded"] = _tokens(server.url, model, prompts, plan.new_tokens, len(prompts))

        def trace(count: int, seed: int) -> list[TraceRequest]:
            return make_trace(
                count,
                plan.trace_prompt_len,
                plan.trace_output_len,
                card["vocab_size"],
                card["max_seq_len"],
                seed,
            )

        record["scenarios"] = {}
        if name not in plan.oracle_only:
            warm = trace(plan.warmup, 99)
            asyncio.run(run_load(server.url, warm, concurrency=len(warm), progress=False, model=model))
        for scenario, (concurrency, count, seed) in plan.scenarios.items():
            if name in plan.oracle_only:
                break
            run = asyncio.run(
                run_load(server.url, trace(count, seed), concurrency=concurrency, progress=False, model=model)
            )
            print(f"[{name}] {scenario}:\n{summary_table(run['summary'])}", flush=True)
            record["scenarios"][scenario] = run["summary"]
        stats = server.get("/v1/engine/stats")
        record["engine_stats"] = {k: v for k, v in stats.items() if k != "startup"}
        record["exit_code"] = server.stop()
    print(f"[{name}] start-up {record['startup']}, exit code {record['exit_code']}", flush=True)
    return record
