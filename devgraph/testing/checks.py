"""The checks of the conformance kit, one function per clause of the backend contract.

Each check builds its own runner(s) with a fresh instance of the target backend, on the platform's
default device, and raises :class:`CheckFailed` with what went wrong and what the contract says.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from devgraph.context import forward_context, is_capturing, is_replaying
from devgraph.errors import CaptureError, DevGraphError, ReplayError
from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch, reference_inputs
from devgraph.runner import GraphRunner, StaticInput
from devgraph.testing._kit import (
    Check,
    CheckFailed,
    CheckSkipped,
    KitContext,
    counting_replays,
)
from devgraph.testing._ops import clear_op_calls, context_scale, op_calls

__all__ = ["CHECKS", "KIT_MODEL_CONFIG"]

#: The reference model the kit captures: one layer, tiny shapes (fast everywhere, float32).
KIT_MODEL_CONFIG = ReferenceConfig.preset(
    "tiny",
    vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
    max_requests=16,
    max_seq_len=32,
)
_WIDTH = 8  # feature width of the kit's small forwards


# -- helpers -------------------------------------------------------------------------------------------
def _model(ctx: KitContext, seed: int = 0) -> ReferenceModel:
    # Enough cache rows for a batch past the largest size (the eager-fallback check runs one).
    config = dataclasses.replace(
        KIT_MODEL_CONFIG, max_requests=max(KIT_MODEL_CONFIG.max_requests, ctx.sizes[-1] + 4)
    )
    model = ReferenceModel(config, device=ctx.device, seed=seed)
    model.randomize_cache(seed=seed)
    return model


def _reference_runner(ctx: KitContext, model: ReferenceModel, **kwargs: Any) -> GraphRunner:
    return ctx.runner(model.decode_step, reference_inputs(model), **kwargs)


def _batch(model: ReferenceModel, n: int, seed: int) -> dict[str, torch.Tensor]:
    return make_decode_batch(model, n, seed=seed)


def _eager(model: ReferenceModel, batch: dict[str, torch.Tensor], context: Any = None) -> torch.Tensor:
    with torch.no_grad(), forward_context(context):
        return model.decode_step(**batch)


def _feature_input() -> dict[str, StaticInput]:
    return {"x": StaticInput(torch.float32, (_WIDTH,))}


@dataclass
class _Context:
    """The forward context the kit hands to ``run``: break ops read ``factor``."""

    factor: float


# -- checks --------------------------------------------------------------------------------------------
def check_static_addresses(ctx: KitContext) -> str:
    """Every replay of one size returns the same output tensors (same storage), with fresh values."""
    model = _model(ctx)
    runner = _reference_runner(ctx, model)
    runner.capture()
    notes = []
    for size in ctx.sizes:
        ptrs = set()
        previous = None
        for seed in range(3):
            batch = _batch(model, size, seed=seed * 31 + size)
            out = runner.run(**batch)
            if tuple(out.shape) != (size, model.config.vocab_size):
                raise CheckFailed(
                    f"size {size}: replay returned shape {tuple(out.shape)}, expected ({size}, "
                    f"{KIT_MODEL_CONFIG.vocab_size})"
                )
            ptrs.add(out.untyped_storage().data_ptr())
            result = runner.verify(**batch)
            if not result.replayed:
                raise CheckFailed(
                    f"size {size} was captured but the step did not replay its graph "
                    "(has_shape or can_run said no)"
                )
            if not result.max_abs_diff <= ctx.options.exact_atol:
                raise CheckFailed(
                    f"size {size}, step {seed}: replay differs from eager on the same padded inputs by "
                    f"{result.max_abs_diff:.3g}: state was baked into the graph at capture"
                )
            current = out.detach().clone()
            if previous is not None and torch.equal(previous, current):
                raise CheckFailed(
                    f"size {size}: two steps with different inputs returned identical outputs; "
                    "replay does not read the static input buffers"
                )
            previous = current
        if len(ptrs) != 1:
            raise CheckFailed(
                f"size {size}: replays returned outputs at {len(ptrs)} different addresses; a graph's "
                "outputs must live at the addresses captured (engines keep views of them)"
            )
        notes.append(f"{size}:{next(iter(ptrs)):#x}")
    return "outputs fixed per size (" + ", ".join(notes) + ")"


def check_padding_rows(ctx: KitContext) -> str:
    """Padding rows get each input's fill (they write only the padding KV slot); real rows match eager."""
    sizes = ctx.sizes
    size = sizes[-1]
    n = size - 1
    graph_model, eager_model = _model(ctx, seed=3), _model(ctx, seed=3)
    runner = _reference_runner(ctx, graph_model)
    runner.capture()
    fills = {name: spec.fill for name, spec in runner.input_specs.items()}
    # Poison the padding rows with values that point at a live slot: a runner that does not write the
    # fill there would replay them into live cache rows.
    live_slot = 1
    for buf in runner.static_inputs.values():
        buf[n:size].fill_(live_slot)
    k_before = [c.detach().clone() for c in graph_model.k_cache]
    batch = _batch(graph_model, n, seed=11)
    batch["req_slots"] = torch.tensor([s for s in range(2, 2 + n)], dtype=torch.int64, device=ctx.device)
    with counting_replays(runner.backend) as replays:
        out = runner.run(**batch)
    if not replays:
        raise CheckFailed(f"a step of {n} rows did not replay the graph of size {size}")
    for name, buf in runner.static_inputs.items():
        pad = buf[n:size]
        if not bool((pad == fills[name]).all()):
            raise CheckFailed(
                f"padding rows {n}..{size - 1} of input {name!r} hold {pad.tolist()}, not its fill "
                f"{fills[name]}: the runner must write each input's fill into padding rows"
            )
    if out.shape[0] != n:
        raise CheckFailed(f"a step of {n} rows returned {out.shape[0]} rows; outputs are sliced back to n")
    want = _eager(eager_model, batch)
    ctx.assert_close(out, want, f"real rows of a {n}-row step padded to {size}")
    touched = set(batch["req_slots"].tolist()) | {graph_model.padding_slot}
    for layer, (before, after, eager_after) in enumerate(
        zip(k_before, graph_model.k_cache, eager_model.k_cache, strict=True)
    ):
        for slot in range(before.shape[0]):
            if slot not in touched and not torch.equal(before[slot], after[slot]):
                raise CheckFailed(
                    f"layer {layer}: KV-cache slot {slot}, which no real row uses, changed during the "
                    "step: padding rows wrote into a live slot"
                )
        for slot in batch["req_slots"].tolist():
            ctx.assert_close(
                after[slot], eager_after[slot], f"layer {layer} KV-cache slot {slot} written by a real row"
            )
    slot = graph_model.padding_slot
    return f"{n} rows padded to {size}; fills {fills}; only the padding slot {slot} absorbed them"


class _Holder(torch.nn.Module):
    """Model state read through the closure (not a runner input), like an engine's weights or caches."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def check_stale_inputs(ctx: KitContext) -> str:
    """Inputs copied into static buffers are fresh; state rebound instead of copied is stale and
    ``verify()`` (replay vs eager) catches it."""
    holder = _Holder(ctx.randn(_WIDTH, _WIDTH, seed=1), ctx.randn(_WIDTH, seed=2))
    runner = ctx.runner(holder, _feature_input())
    runner.capture()
    size = ctx.sizes[-1]
    x1, x2 = ctx.randn(size, _WIDTH, seed=3), ctx.randn(size, _WIDTH, seed=4)
    out1 = runner.run(x=x1).detach().clone()
    ctx.assert_exact(out1, holder(x1), "first step")
    out2 = runner.run(x=x2).detach().clone()
    ctx.assert_exact(out2, holder(x2), "second step (new input values)")
    if torch.equal(out1, out2):
        raise CheckFailed(
            "two steps with different inputs returned the same output: the input was not copied into the "
            "static buffer the graph reads"
        )
    with torch.no_grad():
        holder.bias.add_(1.0)  # an in-place update of captured state: the graph must see it
    ctx.assert_exact(runner.run(x=x2), holder(x2), "step after an in-place update of captured state")
    result = runner.verify(x=x2)
    if not result.max_abs_diff <= ctx.options.exact_atol:
        raise CheckFailed(f"verify() reports {result.max_abs_diff:.3g} on a correct runner; it must be 0")
    # The bug the kit must catch: state rebound to a new tensor instead of copied into the captured one.
    holder.bias = holder.bias + 10.0
    stale = runner.verify(x=x2)
    if not stale.replayed:
        raise CheckFailed("verify() did not replay a captured size")
    if not stale.max_abs_diff > 1.0:
        raise CheckFailed(
            "after the forward's state was rebound to a new tensor (not copied into the captured one) "
            f"the replay still matched eager (diff {stale.max_abs_diff:.3g}): the backend re-runs Python "
            "at replay instead of replaying the captured work, so stale inputs would go unnoticed on a "
            "device and this backend does not behave like a device graph"
        )
    return f"fresh inputs seen; a rebound tensor is stale by {stale.max_abs_diff:.3g} and verify() reports it"


def check_eager_fallback(ctx: KitContext) -> str:
    """Steps past the largest size, and steps before ``capture()``, run the forward eagerly."""
    model, eager_model = _model(ctx, seed=5), _model(ctx, seed=5)
    runner = _reference_runner(ctx, model)
    largest = ctx.sizes[-1]
    early = _batch(model, 2, seed=1)
    ctx.assert_exact(runner.run(**early), _eager(eager_model, early), "a step before capture()")
    runner.capture()
    captured_ptrs = {runner.run(**_batch(model, s, seed=2)).untyped_storage().data_ptr() for s in ctx.sizes}
    for s in ctx.sizes:  # keep the two models' caches in step
        _eager(eager_model, _batch(eager_model, s, seed=2))
    big = largest + 2
    batch = _batch(model, big, seed=7)
    with counting_replays(runner.backend) as replays:
        out = runner.run(**batch)
    if replays:
        raise CheckFailed(
            f"a step of {big} rows (largest captured size {largest}) called replay(); it must run eagerly"
        )
    if tuple(out.shape) != (big, KIT_MODEL_CONFIG.vocab_size):
        raise CheckFailed(f"the eager fallback returned shape {tuple(out.shape)} for {big} rows")
    if out.untyped_storage().data_ptr() in captured_ptrs:
        raise CheckFailed("the eager fallback returned a captured graph output")
    ctx.assert_close(out, _eager(eager_model, batch), f"eager fallback of {big} rows")
    with counting_replays(runner.backend) as replays:
        runner.run(**_batch(model, largest, seed=8))
    if len(replays) != 1:
        raise CheckFailed(f"a step of exactly {largest} rows after the fallback did not replay its graph")
    return f"{big} rows ran eagerly; {largest} rows replayed"


def _break_forward(weight: torch.Tensor) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = context_scale(torch.tanh(x @ weight))
        return y * 2.0 + 1.0

    return forward


def _eager_break(forward: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
    with forward_context(_Context(factor)):
        return forward(x)


def check_break_ops(ctx: KitContext) -> str:
    """Break ops: run eagerly at replay reading the live forward context (``breakable``,
    ``tc_piecewise``), or captured into the graph (``full``) and then correct on fresh inputs."""
    weight = ctx.randn(_WIDTH, _WIDTH, seed=21, scale=0.5)
    forward = _break_forward(weight)
    runner = ctx.runner(forward, _feature_input(), capture_context=lambda size: _Context(1.0))
    clear_op_calls()
    runner.capture()
    capture_calls = op_calls()
    if not capture_calls:
        raise CheckFailed("the break op never ran during capture")
    size = ctx.sizes[-1]
    x = ctx.randn(size, _WIDTH, seed=22)
    clear_op_calls()
    out = runner.run(x=x, context=_Context(3.0)).detach().clone()
    replay_calls = op_calls()
    mode = ctx.break_mode(len(replay_calls))
    if mode == "eager":
        if not replay_calls:
            raise CheckFailed(
                "the break op did not run at replay; with this backend break ops run eagerly between graph "
                "segments"
            )
        if any(c.capturing for c in capture_calls[-1:]):
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
                "not the live 3.0: GraphRunner.run(context=...) must be installed around replay"
            )
        ctx.assert_exact(out, _eager_break(forward, x, 3.0), "replay with a live context")
        clear_op_calls()
        x2 = ctx.randn(size, _WIDTH, seed=23)
        ctx.assert_exact(
            runner.run(x=x2, context=_Context(0.5)),
            _eager_break(forward, x2, 0.5),
            "replay with another live context",
        )
        return f"break op ran eagerly at replay ({len(replay_calls)} call(s)) with the live context"
    # captured: the op's kernels are part of the graph; Python-level host state is baked in at capture.
    if not capture_calls[-1].capturing:
        raise CheckFailed("the break op saw is_capturing() False while captured into the graph")
    ctx.assert_exact(
        out,
        _eager_break(forward, x, 1.0 if not replay_calls else 3.0),
        "replay of a graph with a captured break op",
    )
    x2 = ctx.randn(size, _WIDTH, seed=24)
    clear_op_calls()
    out2 = runner.run(x=x2, context=None)
    ctx.assert_exact(
        out2, _eager_break(forward, x2, 1.0), "replay of a graph with a captured break op, new inputs"
    )
    note = (
        "Python re-ran at replay (a simulator records custom ops whole)"
        if replay_calls
        else "no Python at replay"
    )
    return f"break op captured into the graph; {note}"


def check_has_shape(ctx: KitContext) -> str:
    """``has_shape`` is true exactly for captured sizes; replaying another size raises ``ReplayError``."""
    model = _model(ctx)
    backend = ctx.new_backend()
    runner = _reference_runner(ctx, model, backend=backend)
    sizes = ctx.sizes
    others = sorted({sizes[-1] + 1, *[s + 1 for s in sizes if s + 1 not in sizes]})
    if any(backend.has_shape(s) for s in sizes):
        raise CheckFailed("has_shape() is true before capture()")
    runner.capture()
    missing = [s for s in sizes if not backend.has_shape(s)]
    if missing:
        raise CheckFailed(f"has_shape() is false for captured sizes {missing}")
    extra = [s for s in others if backend.has_shape(s)]
    if extra:
        raise CheckFailed(f"has_shape() is true for sizes never captured: {extra}")
    keys = backend.captured_keys()
    if keys and sorted(keys) != list(sizes):
        raise CheckFailed(f"captured_keys() is {keys}, expected {list(sizes)}")
    try:
        backend.replay(others[0], runner.static_inputs)
    except ReplayError:
        pass
    except DevGraphError as exc:
        raise CheckFailed(
            f"replay() of an uncaptured size raised {type(exc).__name__}, expected ReplayError"
        ) from exc
    else:
        raise CheckFailed(f"replay() of size {others[0]}, which was never captured, did not raise")
    runner.close()
    left = [s for s in sizes if backend.has_shape(s)]
    if left:
        raise CheckFailed(f"has_shape() is still true for {left} after close() (cleanup())")
    return f"captured {list(sizes)}; not {others}"


def check_cleanup(ctx: KitContext) -> str:
    """``close()``/``cleanup()`` drops every graph and output (weak references die, reserved memory
    falls) and the backend can capture again."""
    platform = ctx.platform
    gc.collect()
    ctx.synchronize()
    platform.empty_cache()
    before = platform.reserved_bytes()
    model = _model(ctx)
    backend = ctx.new_backend()
    runner = _reference_runner(ctx, model, backend=backend)
    runner.capture()
    ctx.synchronize()
    held = platform.reserved_bytes()
    refs = [weakref.ref(runner.run(**_batch(model, s, seed=s))) for s in ctx.sizes]
    if any(r() is None for r in refs):
        raise CheckFailed(
            "a replay output died while the runner was open: outputs must be owned by the graph"
        )
    runner.close()
    gc.collect()
    ctx.synchronize()
    platform.empty_cache()
    after = platform.reserved_bytes()
    alive = sum(r() is not None for r in refs)
    if alive:
        raise CheckFailed(
            f"{alive} captured output tensor(s) are still alive after close(): cleanup() must drop every "
            "reference to graphs, plans and outputs so their pool memory can be freed"
        )
    if held > before and not after < held:
        raise CheckFailed(
            f"reserved device memory did not fall after close(): {before} bytes before capture, {held} "
            f"after, {after} after close()"
        )
    again = _reference_runner(ctx, model, backend=backend)
    again.capture()
    batch = _batch(model, ctx.sizes[-1], seed=9)
    result = again.verify(**batch)
    if not (result.replayed and result.max_abs_diff <= ctx.options.exact_atol):
        raise CheckFailed("the backend did not capture and replay correctly after cleanup()")
    memory = (
        f"reserved {before} -> {held} -> {after} bytes"
        if held > before
        else "platform reports no graph memory growth; checked outputs only"
    )
    return f"outputs released; {memory}; re-capture works"


def _sync_forward(fail_size: int) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        if x.shape[0] == fail_size:
            y = y + float(y.sum().item())  # a host sync: not capturable
        return y

    return forward


def check_capture_errors(ctx: KitContext) -> str:
    """A host sync in the captured forward fails capture with a ``CaptureError`` naming the size; sizes
    captured before it are released; the device captures fine afterwards."""
    sizes = ctx.sizes
    fail_size = sizes[1]  # not the largest: a graph is captured before the failure
    backend = ctx.new_backend()
    runner = ctx.runner(_sync_forward(fail_size), _feature_input(), backend=backend)
    try:
        runner.capture()
    except CaptureError as exc:
        message = str(exc)
        if exc.size != fail_size or str(fail_size) not in message:
            raise CheckFailed(
                f"CaptureError must name the failing size {fail_size}: size={exc.size!r}, message {message!r}"
            ) from exc
        error = message
    except Exception as exc:
        raise CheckFailed(
            f"a failed capture raised {type(exc).__name__} ({exc}), not devgraph.CaptureError "
            "(the runner wraps errors; the platform's translate_capture_error may add advice)"
        ) from exc
    else:
        note = (
            f"platform {ctx.platform.name} did not detect a host sync (.item()) during capture, so capture "
            "succeeded; the check of capture errors does not apply"
        )
        if ctx.options.require_sync_detection:
            raise CheckFailed(note)
        raise CheckSkipped(note)
    left = [s for s in sizes if backend.has_shape(s)]
    if left or backend.captured_keys():
        raise CheckFailed(
            f"after a failed capture, sizes {left or backend.captured_keys()} are still captured; "
            "the runner releases every graph captured so far"
        )
    weight = ctx.randn(_WIDTH, _WIDTH, seed=31)
    clean = ctx.runner(lambda x: torch.relu(x @ weight), _feature_input())
    clean.capture()
    x = ctx.randn(sizes[-1], _WIDTH, seed=32)
    ctx.assert_exact(clean.run(x=x), torch.relu(x @ weight), "a capture after a failed one")
    return error.splitlines()[0][:200]


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
    weight = ctx.randn(_WIDTH, _WIDTH, seed=41, scale=0.5)
    runner = ctx.runner(_break_forward(weight), _feature_input(), backend=backend)
    runner.capture()
    clear_op_calls()
    runner.run(x=ctx.randn(ctx.sizes[-1] + 3, _WIDTH, seed=42), context=_Context(2.0))
    fallback = op_calls()
    if not fallback or any(c.replaying or c.capturing for c in fallback):
        raise CheckFailed("the eager fallback ran the forward with is_replaying()/is_capturing() set")
    clear_op_calls()
    runner.run(x=ctx.randn(ctx.sizes[-1], _WIDTH, seed=43), context=_Context(2.0))
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
    weight = ctx.randn(_WIDTH, _WIDTH, seed=51)

    def forward(x: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return x @ weight  # device code never reads the host buffer

    inputs = {
        "x": StaticInput(torch.float32, (_WIDTH,)),
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
    x = ctx.randn(n, _WIDTH, seed=52)
    with counting_replays(runner.backend) as replays:
        out = runner.run(x=x, seq_lens=lens)
    if len(replays) != 1:
        raise CheckFailed(f"a step of {n} rows did not replay exactly once ({len(replays)} replays)")
    seen = replays[0]["seq_lens"]
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


CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("static_addresses", "outputs keep their addresses across replays", check_static_addresses),
        Check("padding_rows", "padding rows get the fill; real rows unaffected", check_padding_rows),
        Check(
            "stale_inputs",
            "fresh inputs seen; rebound state is stale and verify() catches it",
            check_stale_inputs,
        ),
        Check("eager_fallback", "steps past the largest size run eagerly", check_eager_fallback),
        Check("break_ops", "break ops and the live forward context", check_break_ops),
        Check("has_shape", "has_shape() exactly for captured sizes", check_has_shape),
        Check("cleanup", "close() releases graphs, outputs and memory", check_cleanup),
        Check(
            "capture_errors",
            "a host sync in capture gives CaptureError naming the size",
            check_capture_errors,
        ),
        Check("runtime_session", "is_replaying() set by runtime_session() only", check_runtime_session),
        Check("host_inputs", "host=True inputs reach replay() on the CPU", check_host_inputs),
    )
}
