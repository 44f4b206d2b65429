"""Host time: what devgraph's ``run()`` costs the host beyond the hand-written step, what its lock costs
(against a ``single_thread=True`` twin), and what each break op of a breakable graph adds."""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
from harness.device import Device, host_us

from devgraph import GraphRunner, StaticInput, graph_break
from devgraph.contract.keys import TOKENS

__all__ = ["break_cost"]


_ADD_ONE: Any = None


def add_one_break() -> Any:
    """A trivial break op (registered once per process)."""
    global _ADD_ONE
    if _ADD_ONE is None:

        def add_one(x):  # type: ignore[no-untyped-def]
            return x + 1

        add_one.__annotations__ = {"x": torch.Tensor, "return": torch.Tensor}  # torch reads the schema here
        _ADD_ONE = graph_break("devgraph_bench::add_one")(add_one)
    return _ADD_ONE


_ADD_ONE_INTO: Any = None


def add_one_into_break() -> Any:
    """The same op in the form that writes into an argument and returns nothing (registered once)."""
    global _ADD_ONE_INTO
    if _ADD_ONE_INTO is None:

        def add_one_into(x, out):  # type: ignore[no-untyped-def]
            torch.add(x, 1, out=out)

        add_one_into.__annotations__ = {"x": torch.Tensor, "out": torch.Tensor, "return": None}
        _ADD_ONE_INTO = graph_break("devgraph_bench::add_one_into", mutates_args=("out",))(add_one_into)
    return _ADD_ONE_INTO


def break_cost(dev: Device, n: int, iters: int) -> dict[str, Any]:
    """devgraph's host cost per break: a forward of ``n`` (kernel, trivial break op) pairs captured by
    ``full`` and by ``breakable``; ``iters`` calls per host-time sample. Two forms of the op: one that
    returns a new tensor (devgraph copies it where the next segment reads it) and one that writes into an
    argument the segment allocated (``mutates_args``; nothing to copy)."""
    op, op_into = add_one_break(), add_one_into_break()
    hidden = 1024 if dev.cuda else 64

    def forward(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            x = op(x * 1.0)  # one kernel in the segment, then the break
        return x * 1.0

    def forward_into(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            y = x * 1.0
            x = torch.empty_like(y)  # allocated by the segment (no kernel): the op writes here
            op_into(y, x)
        return x * 1.0

    inputs = {"x": StaticInput(torch.float32, (hidden,), fill=0.0)}
    forwards = {"": forward, "_into": forward_into}
    runners = {
        mode + form: GraphRunner(
            fn,
            phase="decode",
            inputs=inputs,
            sizes=[1],
            mode=mode,
            device=dev.device,
            progress=False,
            output_axes=[TOKENS],
        )
        for form, fn in forwards.items()
        for mode in ("full", "breakable")
    }
    for runner in runners.values():
        runner.capture()
    x = torch.randn(1, hidden, device=dev.device)
    expected = forward(x)
    out: dict[str, Any] = {"breaks": n, "exact": {}}
    host: dict[str, list[float]] = {m: [] for m in runners}
    for _ in range(5):
        for mode, runner in runners.items():
            host[mode].append(host_us(dev, functools.partial(runner.run, x=x), iters))
    for mode, runner in runners.items():
        out["exact"][mode] = bool(torch.equal(runner.run(x=x), expected))
        out[f"{mode}_run_us"] = round(statistics.median(host[mode]), 2)
        out[f"{mode}_latency_ms"] = round(
            statistics.median(dev.time_step(functools.partial(runner.run, x=x))[0] for _ in range(20)), 4
        )
    body, body_into = op.replay_fn(), op_into.replay_fn()
    y = torch.empty_like(x)
    out["op_body_us"] = round(host_us(dev, lambda: body(x), iters), 2)
    out["op_into_body_us"] = round(host_us(dev, lambda: body_into(x, y), iters), 2)
    out["copy_us"] = round(host_us(dev, lambda: y.copy_(x), iters), 2)
    if dev.cuda:  # what one more graph segment costs the host: a one-kernel graph's replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            z = x * 1.0
        out["one_kernel_graph_replay_us"] = round(host_us(dev, graph.replay, iters), 2)
        del z
    out["per_break_us"] = round((out["breakable_run_us"] - out["full_run_us"]) / n, 2)
    out["devgraph_per_break_us"] = round(out["per_break_us"] - out["op_body_us"], 2)
    out["per_break_into_us"] = round((out["breakable_into_run_us"] - out["full_into_run_us"]) / n, 2)
    out["devgraph_per_break_into_us"] = round(out["per_break_into_us"] - out["op_into_body_us"], 2)
    out["definition"] = (
        f"forward = {n} x (one elementwise kernel, then a trivial break op x + 1) + one kernel, on a "
        f"[1, {hidden}] float32 tensor; full captures it as one graph, breakable as {n + 1} segments and "
        f"{n} breaks. per_break_us = (breakable run() host us - full run() host us) / {n}: what each "
        "break adds to the host's step (one more segment launch, the op's function, copying its output "
        "where the next segment reads it). devgraph_per_break_us = per_break_us - op_body_us (the op's "
        "own function called directly). The _into figures: the same with the op writing into an "
        "argument the segment allocated and returning nothing (mutates_args), so there is no output to copy. "
        "Host times: median of rounds, synchronized before each call."
    )
    for runner in runners.values():
        runner.close()
    return out
