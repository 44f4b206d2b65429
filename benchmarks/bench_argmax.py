"""Greedy tokens on a GPU: ``torch.argmax`` against the two Triton kernels of
``devgraph.reference.kernels.triton_argmax`` at each chunk width, over a served vocabulary.

    python benchmarks/bench_argmax.py            # a GPU: $OUT/argmax.json and .png (else benchmarks/results/)

Per row count (1-256 rows of 151936 bfloat16 logits, Qwen3's vocabulary) and variant: microseconds per call
inside a CUDA graph of 20 calls (the device's time, launches included as a graph launches them) and
issued eagerly back to back (as the serving engine issues them after each replay: every launch's gap
counted), medians over 7 rounds in which the variants take turns; the floor is the logits' bytes at the
device's measured copy bandwidth. Every variant's tokens are checked against ``torch.argmax`` first.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VOCAB = 151936
BLOCKS = (1024, 2048, 4096, 8192)


def _graph_of_calls(call: Any, calls: int) -> Any:
    from harness.timing import graph_of

    def many() -> None:
        for _ in range(calls):
            call()

    graph, _ = graph_of(many)
    return graph


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path (default: $OUT/argmax.json, else benchmarks/results/)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_argmax.py times GPU kernels: no CUDA GPU here", file=sys.stderr)
        return 2
    from harness.device import Device
    from harness.floor import copy_bandwidth
    from harness.timing import steps_in_turns

    from devgraph.reference.kernels.triton_argmax import BLOCK, argmax_rows

    out = Path(args.out or Path(os.environ.get("OUT", "benchmarks/results")) / "argmax.json")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # bytes read per second by a large device-to-device copy (its figure counts bytes read and written)
    copy_gbps = copy_bandwidth(Device("cuda"), 128 << 20)["GBps"] / 2
    result: dict[str, Any] = {
        "meta": {
            "command": "python3 benchmarks/bench_argmax.py " + " ".join(argv or sys.argv[1:]),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "vocab": args.vocab,
            "dtype": "bfloat16",
            "default_block": BLOCK,
            "copy_read_gbps": round(copy_gbps, 1),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "rows": {},
    }
    for rows in ROWS:
        x = torch.randn(rows, args.vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
        expected = x.argmax(-1)
        variants: dict[str, Any] = {"torch.argmax": functools.partial(torch.argmax, x, -1)}
        for block in BLOCKS:
            variants[f"triton {block}"] = functools.partial(argmax_rows, x, block=block)
        for name, call in variants.items():
            assert torch.equal(call(), expected), (rows, name)
        graphs = {name: _graph_of_calls(call, 20) for name, call in variants.items()}
        in_graph = steps_in_turns({name: g.replay for name, g in graphs.items()}, steps=5)
        eager = steps_in_turns(variants, steps=20)
        floor_us = rows * args.vocab * 2 / (copy_gbps * 1e9) * 1e6
        row = {
            "floor_us": round(floor_us, 3),
            "in_graph_us": {name: round(ms * 1e3 / 20, 2) for name, ms in in_graph.items()},
            "eager_us": {name: round(ms * 1e3, 2) for name, ms in eager.items()},
        }
        result["rows"][str(rows)] = row
        print(f"rows {rows}: in a graph {row['in_graph_us']}; eager {row['eager_us']}", flush=True)
        del graphs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    from harness.plots import Panel, plot_panels

    rows = list(result["rows"])
    panels = []
    for where, label in (("in_graph_us", "inside a CUDA graph"), ("eager_us", "issued eagerly")):
        names = list(result["rows"][rows[0]][where])
        panels.append(
            Panel(
                title=f"greedy tokens, {label}",
                x=rows,
                series={n: [result["rows"][r][where][n] for r in rows] for n in names},
                ylabel="us per call (median)",
                xlabel="rows of logits",
                reference={"logits' bytes at copy bandwidth": [result["rows"][r]["floor_us"] for r in rows]},
            )
        )
    plot_panels(path, panels, f"{result['meta']['device']}: argmax over {result['meta']['vocab']} logits")


if __name__ == "__main__":
    sys.exit(main())
