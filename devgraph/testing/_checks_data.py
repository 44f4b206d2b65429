"""Checks of what a replay computes and writes: output addresses, padding rows, stale rows beyond the
bucket, exactly one execution per step, fresh inputs, and the eager fallback."""

from __future__ import annotations

import torch

from devgraph.testing._fixtures import (
    WIDTH,
    Holder,
    block_batch,
    changed_blocks,
    counter_forward,
    eager_step,
    feature_input,
    free_blocks,
    kit_model,
    padding_problems,
    reference_runner,
    snapshot_caches,
)
from devgraph.testing._kit import CheckFailed, KitContext, counting_replays

__all__ = [
    "check_eager_fallback",
    "check_padding_rows",
    "check_stale_inputs",
    "check_stale_rows",
    "check_static_addresses",
    "check_step_once",
]


def check_static_addresses(ctx: KitContext) -> str:
    """Every replay of one size returns the same output tensors (same storage) with fresh values, equal
    to eager on the same padded inputs, and of the step's shape."""
    model = kit_model(ctx)
    runner = reference_runner(ctx, model)
    runner.capture()
    vocab = model.config.vocab_size
    blocks = free_blocks(model, seed=1)
    notes = []
    for size in ctx.sizes:
        ptrs = set()
        previous = None
        for step in range(3):
            batch = block_batch(model, blocks[:size], seed=step * 31 + size)
            out = runner.run(**batch)
            if tuple(out.shape) != (size, vocab):
                raise CheckFailed(
                    f"size {size}: the step returned shape {tuple(out.shape)}, expected ({size}, {vocab}): "
                    "the graph replayed for this size was not captured with this size's inputs"
                )
            ptrs.add(out.untyped_storage().data_ptr())
            result = runner.verify(**batch)
            if not result.replayed:
                raise CheckFailed(
                    f"size {size} was captured but the step did not replay its graph "
                    "(has_shape or can_run said no, so the runner ran it eagerly)"
                )
            if result.leaves == 0 or not result.structure_matches:
                raise CheckFailed(
                    f"size {size}: verify() compared {result.leaves} tensors (structure matches: "
                    f"{result.structure_matches}); the replay's outputs do not have the eager structure"
                )
            if not result.max_abs_diff <= ctx.options.exact_atol:
                raise CheckFailed(
                    f"size {size}, step {step}: replay differs from eager on the same padded inputs by "
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
    """Padding rows get each input's fill, so they write only the scratch block 0: every KV block no real
    request owns is untouched by capture and by the step; real rows and their blocks match eager."""
    size = ctx.sizes[-1]
    n = size - 1
    graph_model, eager_model = kit_model(ctx, seed=3), kit_model(ctx, seed=3)
    blocks = free_blocks(graph_model, seed=3)
    owned, live = blocks[:n], blocks[n]  # ``live``: a block some other request owns
    before = snapshot_caches(graph_model)
    runner = reference_runner(ctx, graph_model)
    runner.capture()
    captured = changed_blocks(before, graph_model) - {0}
    if captured:
        raise CheckFailed(
            f"capture() (warm-ups on padding rows, then the capture) wrote KV blocks {sorted(captured)}, "
            "which no request owns: only the scratch block 0 may absorb padding rows"
        )
    # Poison the rows past the step with values pointing at a live block: a runner that does not write the
    # fill there would replay them into that block.
    poison = {"slot_mapping": live * graph_model.config.block_size + 3, "block_tables": live}
    for name, buf in runner.static_inputs.items():
        buf[n:].fill_(poison.get(name, 1))
    batch = block_batch(graph_model, owned, seed=11)
    with counting_replays(runner.backend) as replays:
        out = runner.run(**batch)
    if len(replays) != 1:
        raise CheckFailed(f"a step of {n} rows made {len(replays)} replay() calls, expected 1")
    key = replays[0].key
    problems = padding_problems(runner, key, {"tokens": n, "requests": n})
    if problems:
        raise CheckFailed("; ".join(problems) + ": the runner must write each input's fill into padding rows")
    if out.shape[0] != n:
        raise CheckFailed(f"a step of {n} rows returned {out.shape[0]} rows; outputs are cut back to n")
    ctx.assert_close(out, eager_step(eager_model, batch), f"real rows of a {n}-row step padded to {size}")
    touched = changed_blocks(before, graph_model) - {0}
    stray = touched - set(owned)
    if stray:
        raise CheckFailed(
            f"KV blocks {sorted(stray)}, which no real request of the step owns, changed during the step: "
            f"padding rows (or rows past the step) wrote into live blocks (poisoned block: {live})"
        )
    for layer, (got, want) in enumerate(
        zip(
            (*graph_model.k_cache, *graph_model.v_cache),
            (*eager_model.k_cache, *eager_model.v_cache),
            strict=True,
        )
    ):
        ctx.assert_close(
            got[owned], want[owned], f"KV cache {layer} (K caches, then V): blocks written by the real rows"
        )
    return f"{n} rows padded to {size}; only the scratch block 0 absorbed padding rows"


def check_stale_rows(ctx: KitContext) -> str:
    """Rows of the static buffers past a step's bucket hold a larger earlier step's live values; replaying
    them (a larger graph than the key) rewrites KV blocks the engine has since handed to new requests."""
    big, small = ctx.sizes[-1], ctx.sizes[-2]
    graph_model, eager_model = kit_model(ctx, seed=7), kit_model(ctx, seed=7)
    runner = reference_runner(ctx, graph_model)
    runner.capture()
    blocks = free_blocks(graph_model, seed=7)
    first_blocks, second_blocks = blocks[:big], blocks[big : big + small]
    first = block_batch(graph_model, first_blocks, seed=71)
    runner.run(**first)
    eager_step(eager_model, first)
    # The requests of the rows past ``small`` finish; the engine hands their blocks to new requests and
    # writes those requests' keys and values (fresh values) into every layer's cache.
    reassigned = first_blocks[small:]
    generator = torch.Generator().manual_seed(72)
    for graph_cache, eager_cache in zip(
        (*graph_model.k_cache, *graph_model.v_cache),
        (*eager_model.k_cache, *eager_model.v_cache),
        strict=True,
    ):
        fresh = torch.randn(graph_cache[reassigned].shape, generator=generator).to(graph_cache.device)
        graph_cache[reassigned] = fresh
        eager_cache[reassigned] = fresh
    before = snapshot_caches(graph_model)
    second = block_batch(graph_model, second_blocks, seed=73)
    with counting_replays(runner.backend) as replays:
        out = runner.run(**second)
    if len(replays) != 1 or replays[0].key.tokens != small:
        raise CheckFailed(
            f"a step of {small} rows made {len(replays)} replay() calls with keys "
            f"{[str(c.key) for c in replays]}; expected one replay of tokens={small}"
        )
    stray = changed_blocks(before, graph_model) - set(second_blocks) - {0}
    if stray:
        hit = sorted(stray & set(reassigned))
        raise CheckFailed(
            f"a {small}-row step after a {big}-row step changed KV blocks {sorted(stray)} it does not own"
            + (f" (reassigned to new requests: {hit})" if hit else "")
            + ": the backend re-ran the stale rows past the step's bucket (it replayed a larger graph than "
            "the key, or a graph captured with a larger key's views)"
        )
    ctx.assert_close(out, eager_step(eager_model, second), f"a {small}-row step after a {big}-row step")
    return f"{small} rows after {big}: stale rows {small}..{big - 1} not re-run; blocks {reassigned} intact"


def check_step_once(ctx: KitContext) -> str:
    """A forward that is not idempotent (an in-place step counter in the closure) runs exactly once per
    step on every path; ``capture()`` leaves the declared counter as it found it."""
    counter = torch.zeros((), device=ctx.device)  # 0-dim: broadcasts without a size-1 dimension
    runner = ctx.runner(counter_forward(counter), feature_input(), state=[counter])

    def step(rows: int, seed: int, what: str) -> None:
        x = ctx.randn(rows, WIDTH, seed=seed)
        before = float(counter.item())
        out = runner.run(x=x)
        after = float(counter.item())
        if after != before + 1:
            raise CheckFailed(
                f"{what}: the step counter advanced by {after - before:g}, not 1: the forward ran "
                f"{after - before:g} times in one step (a replay repeated, or a replay plus an eager run)"
            )
        ctx.assert_exact(out, x * after, f"{what}: output of the counter forward")

    step(2, 1, "a step before capture()")
    found = float(counter.item())
    runner.capture()
    if float(counter.item()) != found:
        raise CheckFailed(
            f"capture() left the declared state counter at {float(counter.item()):g}, not {found:g}: "
            "warm-ups are undone through state=, and a capture must not execute the forward's writes"
        )
    seed = 10
    for size in ctx.sizes:
        for rows in sorted({size, max(1, size - 1)}):
            seed += 1
            step(rows, seed, f"a step of {rows} rows (graph of size {size})")
    step(ctx.sizes[-1] + 1, 99, f"a step of {ctx.sizes[-1] + 1} rows (eager fallback)")
    before = float(counter.item())
    result = runner.verify(x=ctx.randn(ctx.sizes[-1], WIDTH, seed=100))
    if float(counter.item()) != before or not result.ok:
        raise CheckFailed(
            f"verify() of the counter forward: counter {before:g} -> {float(counter.item()):g}, "
            f"result {result}; verify must restore declared state and agree with eager"
        )
    return f"counter advanced once per step; {float(counter.item()):g} steps"


def check_stale_inputs(ctx: KitContext) -> str:
    """Inputs copied into static buffers are fresh; state rebound instead of copied is stale and
    ``verify()`` (replay vs eager) catches it."""
    holder = Holder(ctx.randn(WIDTH, WIDTH, seed=1), ctx.randn(WIDTH, seed=2))
    # The runner's address guard would name the rebound tensor before any replay; this check is about the
    # backend: that its replay runs the captured work, which verify() shows once the guard is off.
    runner = ctx.runner(holder, feature_input(), address_guard=False)
    runner.capture()
    size = ctx.sizes[-1]
    x1, x2 = ctx.randn(size, WIDTH, seed=3), ctx.randn(size, WIDTH, seed=4)
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
    """Steps past the largest size, and steps before ``capture()``, run the forward eagerly (no replay)."""
    model, eager_model = kit_model(ctx, seed=5), kit_model(ctx, seed=5)
    runner = reference_runner(ctx, model)
    largest = ctx.sizes[-1]
    blocks = free_blocks(model, seed=5)
    early = block_batch(model, blocks[:2], seed=1)
    with counting_replays(runner.backend) as replays:
        out = runner.run(**early)
    if replays:
        raise CheckFailed("a step before capture() called replay(); it must run eagerly")
    ctx.assert_exact(out, eager_step(eager_model, early), "a step before capture()")
    runner.capture()
    captured_ptrs = set()
    for s in ctx.sizes:
        batch = block_batch(model, blocks[:s], seed=2)
        captured_ptrs.add(runner.run(**batch).untyped_storage().data_ptr())
        eager_step(eager_model, batch)  # keep the two models' caches in step
    big = largest + 2
    batch = block_batch(model, blocks[:big], seed=7)
    with counting_replays(runner.backend) as replays:
        out = runner.run(**batch)
    if replays:
        raise CheckFailed(
            f"a step of {big} rows (largest captured size {largest}) called replay(); it must run eagerly"
        )
    vocab = model.config.vocab_size
    if tuple(out.shape) != (big, vocab):
        raise CheckFailed(f"the eager fallback returned shape {tuple(out.shape)} for {big} rows")
    if out.untyped_storage().data_ptr() in captured_ptrs:
        raise CheckFailed("the eager fallback returned a captured graph output")
    ctx.assert_close(out, eager_step(eager_model, batch), f"eager fallback of {big} rows")
    with counting_replays(runner.backend) as replays:
        runner.run(**block_batch(model, blocks[:largest], seed=8))
    if len(replays) != 1:
        raise CheckFailed(f"a step of exactly {largest} rows after the fallback did not replay its graph")
    return f"{big} rows ran eagerly; {largest} rows replayed"
