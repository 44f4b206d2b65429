"""Why a hand-written graph of the reference decoder seemed to replay faster than devgraph's of the same
kernels in ``bench_linear.py`` (1.25 against 1.38 ms at batch 1 on an H200), while ``replay_vs_hand.py``
found them level: the same graphs timed in turn, without and then with an eager step in each round (as
``bench_linear.py`` timed them until round 10).

    python3 benchmarks/replay_after_eager.py       # a GPU; prints, and writes $OUT/replay-after-eager.json

Qwen3-0.6B's reference decoder with cuBLAS projections, batch 1, ``bench_linear.py``'s configuration. The
graphs: ``hand`` (``torch.cuda.graph`` of ``model.decode_step`` on the batch's own tensors, captured after
the runners, as ``bench_linear.py`` does), ``hand first`` (captured before any runner), ``hand
thread-local`` (captured as devgraph captures: ``capture_error_mode="thread_local"``, a pool of its own, a
side stream), ``plain graph_of`` (``harness.timing.graph_of``), ``devgraph 1`` and ``devgraph 1 of 7``
(the runner's graph of batch 1, the runner capturing batch 1 alone or the seven sizes 1-64 into one pool).
Each replayed alone, and ``runner.run()``; medians of seven rounds of 20 steps, the variants taking turns.
Then three of them again with 20 eager steps first in each round, in two orders.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from bench_linear import cublas_only, model_config
from harness.timing import graph_of, steps_in_turns


def hand_graph(call: Any, thread_local: bool = False) -> Any:
    """A ``torch.cuda.CUDAGraph`` of ``call``: the standard recipe (``graph_of``), or captured as devgraph
    captures (``thread_local``)."""
    if not thread_local:
        return graph_of(call)[0]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
        torch.cuda.synchronize()
        graph.capture_begin(pool=torch.cuda.graph_pool_handle(), capture_error_mode="thread_local")
        call()
        graph.capture_end()
    torch.cuda.synchronize()
    return graph


def main() -> int:
    if not torch.cuda.is_available():
        print("replay_after_eager.py takes graphs apart on a GPU: no CUDA GPU here", file=sys.stderr)
        return 2
    from devgraph.reference import ReferenceModel, decode_runner, make_decode_batch

    out = Path(os.environ.get("OUT", "benchmarks/results")) / "replay-after-eager.json"
    report: dict[str, Any] = {
        "meta": {
            "command": "python3 benchmarks/replay_after_eager.py",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
        },
    }
    with cublas_only():
        model = ReferenceModel(model_config("qwen3-0.6b"), device="cuda", seed=0)
        batch = make_decode_batch(model, 1, seq_lens=256, seed=1)
        step = functools.partial(model.decode_step, **batch)
        graphs: dict[str, Any] = {"hand first": hand_graph(step)}
        one = decode_runner(model, mode="full", sizes=[1], progress=False)
        one.capture()
        seven = decode_runner(model, mode="full", sizes=[1, 2, 4, 8, 16, 32, 64], progress=False)
        seven.capture()
        graphs["hand"] = hand_graph(step)
        graphs["hand thread-local"] = hand_graph(step, thread_local=True)
        graphs["plain graph_of"], _ = graph_of(step)
        runners = {"devgraph 1": one, "devgraph 1 of 7": seven}
        for name, runner in runners.items():
            runner.run(**batch)
            backend = runner.life.sets.all[0].backend
            key = next(k for k in backend._entries if k.tokens == 1)
            graphs[name] = backend._entries[key].graph
        calls: dict[str, Any] = {f"{name} replay": g.replay for name, g in graphs.items()}
        calls.update({f"{name} run()": functools.partial(r.run, **batch) for name, r in runners.items()})
        times = steps_in_turns(calls)
        # bench_linear.py times an eager step first in each round: the same graphs in turn after one, in
        # two orders (which graph comes right after the eager steps)
        orders = {
            "after eager, devgraph first": ["devgraph 1 of 7 replay", "hand replay", "devgraph 1 replay"],
            "after eager, hand first": ["hand replay", "devgraph 1 of 7 replay", "devgraph 1 replay"],
        }
        ordered = {}
        for label, names in orders.items():
            turn = {"eager": step, **{name: calls[name] for name in names}}
            ordered[label] = {name: round(ms, 4) for name, ms in steps_in_turns(turn).items()}
            print(label, ordered[label], flush=True)
    report["ms_per_step"] = {name: round(ms, 4) for name, ms in times.items()}
    report["ms_per_step_after_eager"] = ordered
    for name, ms in times.items():
        print(f"{name:32s} {ms:.4f} ms", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
