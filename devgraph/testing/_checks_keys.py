"""Checks of keys beyond the token count: variants get graphs of their own, and lazily captured keys are
captured on first sight, replayed, evicted with ``release()`` and captured again."""

from __future__ import annotations

import gc
import weakref

import torch

from devgraph import DevGraphError, GraphKey, ReplayError
from devgraph.testing._fixtures import WIDTH, feature_input
from devgraph.testing._kit import CheckFailed, KitContext, counting_replays

__all__ = ["check_lazy_capture", "check_variants"]


def check_variants(ctx: KitContext) -> str:
    """Every variant value is a key of its own: each is captured, held and replayed separately (a backend
    that keys graphs by the token count alone replays one variant's graph for the other)."""
    weight = ctx.randn(WIDTH, WIDTH, seed=71, scale=0.5)

    def forward(x: torch.Tensor, scaled: bool) -> torch.Tensor:
        y = torch.tanh(x @ weight)
        return y * 3.0 if scaled else y - 2.0

    runner = ctx.runner(forward, feature_input(), variants={"scaled": (False, True)})
    runner.capture()
    keys = runner.schedule.keys()
    missing = [str(k) for k in keys if not runner.backend.has_shape(k)]
    if missing:
        raise CheckFailed(f"keys {missing} were captured but has_shape() says no")
    seed = 72
    for size in ctx.sizes:
        for scaled in (False, True, False):
            seed += 1
            x = ctx.randn(size, WIDTH, seed=seed)
            with counting_replays(runner.backend) as replays:
                out = runner.run(x=x, variant={"scaled": scaled})
            want_key = GraphKey.of(size, variant={"scaled": scaled})
            if [c.key for c in replays] != [want_key]:
                raise CheckFailed(
                    f"a step of variant scaled={scaled} at size {size} replayed "
                    f"{[str(c.key) for c in replays]}, expected {want_key}"
                )
            ctx.assert_exact(out, forward(x, scaled), f"size {size}, variant scaled={scaled}")
    return f"{len(keys)} keys ({len(ctx.sizes)} sizes x 2 variants) replayed separately"


def check_lazy_capture(ctx: KitContext) -> str:
    """A lazily capturing runner (``lazy=True, max_graphs=2``): each key is captured the first time a step
    needs it (the forward still runs once per step), replayed afterwards, evicted with ``release()`` (its
    graph and outputs dropped) and captured again when needed."""
    weight = ctx.randn(WIDTH, WIDTH, seed=75, scale=0.5)
    counter = torch.zeros((), device=ctx.device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        counter.add_(1.0)
        return torch.tanh(x @ weight) * counter

    small, middle, big = ctx.sizes[0], ctx.sizes[-2], ctx.sizes[-1]
    runner = ctx.runner(forward, feature_input(), state=[counter], lazy=True, max_graphs=2)
    runner.capture()
    scheduled = runner.schedule.keys()
    held = [str(k) for k in scheduled if runner.backend.has_shape(k)]
    if held:
        raise CheckFailed(
            f"a lazily capturing runner's capture() captured {held}; it captures on first sight"
        )
    outputs: dict[int, weakref.ref[torch.Tensor]] = {}
    seed = 76
    # big, middle: two captures; big again: a hit; small: evicts middle; middle: captured again, evicts big.
    for rows in (big, middle, big, small, middle):
        seed += 1
        x = ctx.randn(rows, WIDTH, seed=seed)
        before = float(counter.item())
        try:
            with counting_replays(runner.backend) as replays:
                out = runner.run(x=x)
        except DevGraphError as exc:
            raise CheckFailed(f"a lazily captured step of {rows} rows failed: {exc}") from exc
        after = float(counter.item())
        if len(replays) != 1 or after != before + 1:
            raise CheckFailed(
                f"a lazily captured step of {rows} rows made {len(replays)} replays and advanced the "
                f"counter by {after - before:g}; expected one replay and one forward per step"
            )
        ctx.assert_exact(out, torch.tanh(x @ weight) * after, f"a lazily captured step of {rows} rows")
        outputs[rows] = weakref.ref(out)
        key = replays[0].key
        if not runner.backend.has_shape(key):
            raise CheckFailed(f"{key} replayed but has_shape() says it is not held")
    gc.collect()
    evicted = GraphKey(big)
    if runner.backend.has_shape(evicted):
        raise CheckFailed(f"{evicted} was evicted (release()) but has_shape() still says it is held")
    try:
        runner.backend.replay(evicted, runner.static_inputs)
    except ReplayError:
        pass
    except Exception as exc:
        raise CheckFailed(
            f"replay() of the evicted {evicted} raised {type(exc).__name__}, not ReplayError"
        ) from exc
    else:
        raise CheckFailed(f"replay() of the evicted {evicted} still replayed: release() must drop its graph")
    if outputs[big]() is not None:
        raise CheckFailed(f"the outputs of the evicted {evicted} are still alive: release() must drop them")
    lazy = runner.stats().get("lazy", {})
    return (
        f"captured on first sight ({lazy.get('misses')} captures, {lazy.get('hits')} hits), evicted with "
        f"release() ({lazy.get('evictions')} evictions) and captured again"
    )
