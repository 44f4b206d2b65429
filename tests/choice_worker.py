"""One rank for tests/test_choice.py's agreement test, launched torchrun-style (tests/ranks_launch.py).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/choice_worker.py choice --out DIR

Each rank's stand-in timer tells another story (rank 0: the compiled graph 3x slower than the plain one;
rank 1: 2x faster); the runners share a gloo group, so both must keep the same graphs. Findings go to
``DIR/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from devgraph import GraphRunner, StaticInput, create_backend

W = torch.linspace(-1, 1, 16).reshape(4, 4)
COSTS = {0: (3e-3, 1e-3), 1: (1e-3, 2e-3)}  # (compiled, plain) seconds per replay, by rank


def forward(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ W) + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    compiled_s, plain_s = COSTS[rank]
    calls = [0]

    def timer(replay: Callable[[], Any], iters: int) -> float:
        for _ in range(iters):
            replay()
        calls[0] += 1
        return compiled_s if calls[0] % 2 else plain_s

    backend = create_backend("cpu", "decode", "full", options={"compiler": "eager"})
    backend.replay_timer = timer  # type: ignore[attr-defined]
    runner = GraphRunner(
        forward,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (4,))},
        device="cpu",
        sizes=[1, 2, 4],
        backend=backend,
        process_group=dist.group.WORLD,
        progress=False,
    )
    runner.capture()
    info = runner.inspect()["compiled_or_plain"]
    x = torch.randn(3, 4)
    found = {
        "keys": {
            key: (v["kept"], v["why"], v["compiled_ms"], v["plain_ms"]) for key, v in info["keys"].items()
        },
        "abandoned": info["abandoned"],
        "equal_to_eager": bool(torch.allclose(runner.run(x=x), forward(x))),
    }
    runner.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
