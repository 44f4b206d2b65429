"""One data-parallel rank for tests/test_dp.py (and the multi_gpu run), launched torchrun-style.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/dp_worker.py SCENARIOS --out DIR

``SCENARIOS`` is a comma list (``agree``, ``collective``, ``cost``) run in order; findings go to
``DIR/rank<r>.json``. Every rank runs its own batch each step (a different size per rank) on the same
reference model; the runner agrees on one key per step with the group. CPU: gloo over the CPU simulator;
``--device cuda``: NCCL, one GPU per rank (``LOCAL_RANK``), the agreement on devgraph's gloo control group.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner, make_decode_batch

SIZES = [1, 2, 4, 8]
#: Batch sizes per step, per rank (rank r uses row r mod 2); step 4 is past the largest size on rank 0.
STEPS = [[1, 3, 6, 2, 20, 4], [2, 3, 1, 7, 1, 4]]


def model_on(device: torch.device) -> ReferenceModel:
    config = ReferenceConfig.preset(
        "tiny", kernels="auto" if device.type == "cuda" else "torch", max_seq_len=128
    )
    model = ReferenceModel(config, device=device, seed=0)
    model.randomize_cache(seed=1)
    return model


def scenario_agree(ctx: dict[str, Any]) -> dict[str, Any]:
    """Different batch sizes per rank: every rank replays the agreed key, outputs equal eager per rank."""
    model, rank = ctx["model"], ctx["rank"]
    runner = decode_runner(model, mode=ctx["mode"], sizes=SIZES, dp_group=dist.group.WORLD, progress=False)
    runner.capture()
    steps = []
    for i, n in enumerate(STEPS[rank % 2]):
        batch = make_decode_batch(model, n, seq_lens=9 + i, seed=100 * rank + i)
        agreement = runner.agree(n)
        # Half the steps hand the agreement to run(); the others let run() agree again (the same answer).
        out = runner.run(**batch, agreement=agreement if i % 2 else None, copy=True)
        eager = model.decode_step(**batch)
        steps.append(
            {
                "n": n,
                "key": None if agreement.key is None else str(agreement.key),
                "counts": dict(agreement.counts),
                "reason": None if agreement.reason is None else str(agreement.reason),
                "diff": float((out - eager).abs().max()),
                "scale": float(eager.abs().max()),
            }
        )
    stats = runner.stats()
    runner.close()
    return {
        "steps": steps,
        "stats": {k: stats[k] for k in ("replays_by_key", "eager_by_reason", "data_parallel")},
    }


def scenario_collective(ctx: dict[str, Any]) -> dict[str, Any]:
    """A collective inside the graph whose shape follows the step (as an expert-parallel layer after
    data-parallel attention): it only pairs up because every rank replays the agreed key."""
    model, rank = ctx["model"], ctx["rank"]
    group = dist.group.WORLD

    def step(**batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model.decode_step(**batch)
        ones = torch.ones(logits.shape[0], device=logits.device)
        dist.all_reduce(ones, group=group)
        return logits, ones

    from devgraph import GraphRunner
    from devgraph.reference import reference_inputs

    inputs = reference_inputs(model)
    runner = GraphRunner(
        step,
        phase="decode",
        inputs=inputs,
        sizes=SIZES,
        device=model.device,
        mode=ctx["mode"],
        dp_group=group,
    )
    runner.capture()
    sums = []
    for i, n in enumerate([1, 5, 2][rank % 3 :] + [1, 5, 2][: rank % 3]):
        batch = make_decode_batch(model, n, seq_lens=7, seed=i)
        _, ones = runner.run(**batch)
        sums.append(sorted(set(ones.tolist())))
    stats = runner.stats()
    runner.close()
    return {"sums": sums, "world": dist.get_world_size(), "replays": stats["replays"]}


def scenario_cost(ctx: dict[str, Any]) -> dict[str, Any]:
    """Seconds one agreement takes (one all-reduce of a few int64 on the control group), median of many."""
    model, rank = ctx["model"], ctx["rank"]
    runner = decode_runner(model, mode=ctx["mode"], sizes=SIZES, dp_group=dist.group.WORLD, progress=False)
    runner.capture()
    times = []
    for i in range(ctx["iters"]):
        t0 = time.perf_counter()
        runner.agree(1 + (i + rank) % 8)
        times.append(time.perf_counter() - t0)
    transport = runner.stats()["data_parallel"]["transport"]  # the way the first agreement took
    runner.close()
    return {
        "transport": transport,
        "iters": len(times),
        "median_us": statistics.median(times) * 1e6,
        "p90_us": sorted(times)[int(0.9 * len(times))] * 1e6,
    }


def _raised(call: Any) -> dict[str, Any] | None:
    """What ``call()`` raised (type, message, seconds it took), or ``None``."""
    start = time.perf_counter()
    try:
        call()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
    return None


def scenario_sizes(ctx: dict[str, Any]) -> dict[str, Any]:
    """Ranks built with different sizes (issue 27: [1, 2, 4, 8] and [1, 3, 8]) fail on every rank: before
    the first warm-up of capture(), and at a lazily capturing runner's first agreement (no capture to
    compare at), within a second, never replaying different keys."""
    model, rank = ctx["model"], ctx["rank"]
    group = dist.group.WORLD
    # Same sizes first (and the control group built): the same checks pass, no false alarm, one key.
    same = decode_runner(model, mode=ctx["mode"], sizes=[1, 2, 4, 8], dp_group=group, progress=False)
    same.capture()
    agreement = same.agree(1 + 2 * rank)
    same.close()
    sizes = [1, 2, 4, 8] if rank == 0 else [1, 3, 8]
    runner = decode_runner(model, mode=ctx["mode"], sizes=sizes, dp_group=group, progress=False)
    captured = _raised(runner.capture)
    runner.close()
    lazy = decode_runner(model, mode=ctx["mode"], sizes=sizes, dp_group=group, progress=False, lazy=True)
    lazy.capture()
    agreed = _raised(lambda: lazy.agree(4 - rank))  # rank 0 would replay tokens=4, rank 1 tokens=3
    lazy.close()
    return {"capture": captured, "agree": agreed, "same_key": str(agreement.key)}


SCENARIOS = {
    "agree": scenario_agree,
    "collective": scenario_collective,
    "cost": scenario_cost,
    "sizes": scenario_sizes,
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mode", default="full")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    ctx = {"rank": rank, "model": model_on(device), "mode": args.mode, "iters": args.iters}
    results: dict[str, Any] = {"rank": rank, "device": str(device), "torch": torch.__version__}
    out = Path(args.out)
    for name in args.scenarios.split(","):
        try:
            results[name] = SCENARIOS[name](ctx)
        except Exception as exc:
            results[name] = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    from devgraph import ranks

    ranks.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
