"""Checks of what code around the graph sees: break ops and the live forward context, whether code
runs replaying (``is_replaying()``), and host-side inputs."""

from __future__ import annotations

import torch

from devgraph import ReplayError, StaticInput, is_capturing, is_replaying
from devgraph.testing._fixtures import (
    WIDTH,
    BreakContext,
    StaticBreakContext,
    break_forward,
    eager_break,
    feature_input,
)
from devgraph.testing._kit import CheckFailed, KitContext, counting_replays
from devgraph.testing._ops import clear_op_calls, op_calls

__all__ = ["check_break_ops", "check_host_inputs", "check_runtime_session"]


def check_break_ops(ctx: KitContext) -> str:
    """Break ops: run eagerly at replay reading the live forward context (``breakable``,
    ``tc_piecewise``), or captured into the graph (``full``): then a replay whose live context holds
    another value than the capture read is refused (the sanitizer), and with the value declared static
    the graph replays the capture's, correct on fresh inputs."""
    weight = ctx.randn(WIDTH, WIDTH, seed=21, scale=0.5)
    forward = break_forward(weight)
    runner = ctx.runner(forward, feature_input(), capture_context=lambda key: BreakContext(1.0))
    clear_op_calls()
    runner.capture()
    capture_calls = op_calls()
    if not capture_calls:
        raise CheckFailed("the break op never ran during capture")
    size = ctx.sizes[-1]
    x = ctx.randn(size, WIDTH, seed=22)
    clear_op_calls()
    refused: ReplayError | None = None
    try:
        out = runner.run(x=x, context=BreakContext(3.0)).detach().clone()
    except ReplayError as exc:  # the op read the context inside the graph: its value is baked in
        refused = exc
    replay_calls = op_calls()
    mode = ctx.break_mode(len(replay_calls) if refused is None else 0)
    if mode == "eager":
        if refused is not None:
            raise CheckFailed(
                f"a replay with another live context was refused ({refused}): the backend ran the break op "
                "with is_capturing() True, so its reads of the context count as baked into the graph; a "
                "backend that runs break ops eagerly runs them outside the capture"
            )
        if not replay_calls:
            raise CheckFailed(
                "the break op did not run at replay; with this backend break ops run eagerly between graph "
                "segments"
            )
        if capture_calls[-1].capturing:
            raise CheckFailed(
                "the break op saw is_capturing() True at capture; it runs eagerly, outside the graph"
            )
        if not all(c.replaying for c in replay_calls):
            raise CheckFailed(
                "the break op saw is_replaying() False at replay (runtime_session() must set it)"
            )
        if any(c.factor != 3.0 for c in replay_calls):
            raise CheckFailed(
                f"the break op read factor {replay_calls[0].factor} from the forward context at replay, "
                "not the live 3.0: the backend must run break ops inside the context that "
                "run(context=...) installs"
            )
        ctx.assert_exact(out, eager_break(forward, x, 3.0), "replay with a live context")
        x2 = ctx.randn(size, WIDTH, seed=23)
        ctx.assert_exact(
            runner.run(x=x2, context=BreakContext(0.5)),
            eager_break(forward, x2, 0.5),
            "replay with another live context",
        )
        return f"break op ran eagerly at replay ({len(replay_calls)} call(s)) with the live context"
    # captured: the op's kernels are part of the graph; Python-level host state is baked in at capture.
    if not capture_calls[-1].capturing:
        raise CheckFailed("the break op saw is_capturing() False while captured into the graph")
    guard = runner.inspect()["address_guard"] or {}
    if refused is None and guard.get("host_values", {}).get("enabled"):
        raise CheckFailed(
            "a replay whose live context holds factor 3.0 was not refused, though the graph captured the "
            "break op reading factor 1.0 (the runner's host-value check did not see the read)"
        )
    if refused is not None and "context.factor" not in str(refused):
        raise CheckFailed(f"the refused replay does not name context.factor: {refused}")
    # Declared static, the value is the graph's to keep: it replays the capture's, on any inputs.
    static = ctx.runner(forward, feature_input(), capture_context=lambda key: StaticBreakContext(1.0))
    static.capture()
    clear_op_calls()
    out = static.run(x=x, context=BreakContext(3.0)).detach().clone()
    replay_calls = op_calls()
    ctx.assert_exact(
        out,
        eager_break(forward, x, 1.0 if not replay_calls else 3.0),
        "replay of a graph with a captured break op",
    )
    x2 = ctx.randn(size, WIDTH, seed=24)
    clear_op_calls()
    out2 = static.run(x=x2, context=None)
    ctx.assert_exact(
        out2, eager_break(forward, x2, 1.0), "replay of a graph with a captured break op, new inputs"
    )
    note = (
        "Python re-ran at replay (a simulator records custom ops whole)"
        if replay_calls
        else "no Python at replay"
    )
    sanitized = "; a live context with another value refused" if refused is not None else ""
    return f"break op captured into the graph; {note}{sanitized}"


def check_runtime_session(ctx: KitContext) -> str:
    """``runtime_session()`` sets ``is_replaying()`` for the step (break ops see it) and nothing else
    does; eager fallbacks run with it unset."""
    backend = ctx.new_backend()
    if is_replaying() or is_capturing():
        raise CheckFailed("is_replaying()/is_capturing() are set outside any runner")
    with backend.runtime_session():
        inside = is_replaying()
    if backend.uses_graphs and not inside:
        raise CheckFailed(
            "is_replaying() is False inside runtime_session(); break ops and model code rely on it"
        )
    if is_replaying():
        raise CheckFailed("is_replaying() stays True after runtime_session() exits")
    weight = ctx.randn(WIDTH, WIDTH, seed=41, scale=0.5)
    runner = ctx.runner(break_forward(weight), feature_input(), backend=backend)
    runner.capture()
    clear_op_calls()
    runner.run(x=ctx.randn(ctx.sizes[-1] + 3, WIDTH, seed=42), context=BreakContext(2.0))
    fallback = op_calls()
    if not fallback or any(c.replaying or c.capturing for c in fallback):
        raise CheckFailed("the eager fallback ran the forward with is_replaying()/is_capturing() set")
    clear_op_calls()
    runner.run(x=ctx.randn(ctx.sizes[-1], WIDTH, seed=43), context=BreakContext(2.0))
    replayed = op_calls()
    if replayed and not all(c.replaying for c in replayed):
        raise CheckFailed("a break op running at replay saw is_replaying() False")
    if is_replaying():
        raise CheckFailed("is_replaying() stays True after run() returns")
    return "is_replaying() set inside runtime_session() only" + (
        " (seen by the break op)" if replayed else ""
    )


def check_host_inputs(ctx: KitContext) -> str:
    """A ``StaticInput(host=True)`` lives on the CPU; ``replay(key, static_inputs)`` gets it filled for the
    step (real rows, then the fill), which host-side graph updates (Ascend) read."""
    weight = ctx.randn(WIDTH, WIDTH, seed=51)

    def forward(x: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return x @ weight  # device code never reads the host buffer

    inputs = {
        "x": StaticInput(torch.float32, (WIDTH,)),
        "seq_lens": StaticInput(torch.int64, fill=0, host=True),
    }
    runner = ctx.runner(forward, inputs)
    host = runner.static_inputs["seq_lens"]
    if host.device.type != "cpu":
        raise CheckFailed(f"a host=True input was allocated on {host.device}, not the CPU")
    runner.capture()
    size = ctx.sizes[-1]
    n = size - 1
    lens = torch.arange(5, 5 + n, dtype=torch.int64)
    x = ctx.randn(n, WIDTH, seed=52)
    with counting_replays(runner.backend) as replays:
        out = runner.run(x=x, seq_lens=lens)
    if len(replays) != 1:
        raise CheckFailed(f"a step of {n} rows did not replay exactly once ({len(replays)} replays)")
    seen = replays[0].static_inputs["seq_lens"]
    if (
        seen.device.type != "cpu"
        or seen[:n].tolist() != lens.tolist()
        or seen[n:size].tolist() != [0] * (size - n)
    ):
        raise CheckFailed(
            f"replay() got seq_lens {seen[:size].tolist()} on {seen.device}; "
            f"expected {lens.tolist() + [0] * (size - n)} on the CPU"
        )
    ctx.assert_close(out, x @ weight, "output of a runner with a host-side input")
    return f"replay() saw the host buffer {seen[:size].tolist()}"
