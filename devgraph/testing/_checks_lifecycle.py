"""Checks of a backend's life cycle: which keys it holds, failed captures, release and cleanup, capture
errors, and ownership by one runner."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Mapping

import torch

from devgraph import CaptureError, DevGraphError, GraphKey, ReplayError
from devgraph.testing._fixtures import (
    WIDTH,
    feature_input,
    free_blocks,
    kit_model,
    reference_runner,
    sync_forward,
)
from devgraph.testing._fixtures import block_batch as _batch
from devgraph.testing._kit import CheckFailed, CheckSkipped, KitContext

__all__ = [
    "check_capture_errors",
    "check_cleanup",
    "check_failed_capture",
    "check_has_shape",
    "check_ownership",
]


def _replay_raises(backend: object, key: GraphKey, buffers: Mapping[str, torch.Tensor]) -> str | None:
    """``None`` when ``replay(key)`` raises :class:`ReplayError`, else what happened instead."""
    try:
        backend.replay(key, buffers)  # type: ignore[attr-defined]
    except ReplayError:
        return None
    except Exception as exc:  # any other error is a contract breach too, reported as such
        return f"raised {type(exc).__name__} ({exc}), not ReplayError"
    return "replayed"


def check_has_shape(ctx: KitContext) -> str:
    """``has_shape`` is true exactly for captured keys (every axis counts); ``captured_keys()`` lists them;
    replaying another key raises ``ReplayError``."""
    model = kit_model(ctx)
    backend = ctx.new_backend()
    runner = reference_runner(ctx, model, backend=backend)
    keys = runner.schedule.keys()
    sizes = ctx.sizes
    others = [GraphKey.of(s + 1, {"requests": s + 1}) for s in sizes if s + 1 not in sizes]
    others += [GraphKey.of(s, {"requests": s + 1}) for s in sizes]  # same tokens, another request bucket
    others += [GraphKey(s) for s in sizes]  # the axes left out
    if any(backend.has_shape(k) for k in keys):
        raise CheckFailed("has_shape() is true before capture()")
    runner.capture()
    missing = [str(k) for k in keys if not backend.has_shape(k)]
    if missing:
        raise CheckFailed(f"has_shape() is false for captured keys {missing}")
    extra = [str(k) for k in others if backend.has_shape(k)]
    if extra:
        raise CheckFailed(
            f"has_shape() is true for keys never captured: {extra} (every axis is part of a key)"
        )
    listed = backend.captured_keys()
    if listed and (sorted(k.tokens for k in listed) != list(sizes) or set(listed) != set(keys)):
        raise CheckFailed(f"captured_keys() is {[str(k) for k in listed]}, expected {[str(k) for k in keys]}")
    problem = _replay_raises(backend, others[0], runner.static_inputs)
    if problem:
        raise CheckFailed(f"replay() of {others[0]}, which was never captured, {problem}")
    runner.close()
    left = [str(k) for k in keys if backend.has_shape(k)]
    if left:
        raise CheckFailed(f"has_shape() is still true for {left} after close() (cleanup())")
    return f"captured {sorted(k.tokens for k in keys)}; not {[str(k) for k in others[:2]]}, ..."


class _DeliberateFailure(RuntimeError):
    """Raised by the kit inside ``capture_one``'s forward to fail one capture on purpose."""


def check_failed_capture(ctx: KitContext) -> str:
    """A ``capture_one`` whose forward raises leaves nothing of its key behind (``has_shape`` false, not
    listed, not replayable), and the same key then captures and replays correctly."""
    backend = ctx.new_backend()
    weight = ctx.randn(WIDTH, WIDTH, seed=61)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight) + 1.0

    size = ctx.sizes[-1]
    key = GraphKey(size)
    buffers = {"x": torch.zeros(size, WIDTH, device=ctx.device)}
    backend.prepare(feature_input())
    graph_forward = backend.wrap_forward(forward)

    def failing() -> torch.Tensor:
        graph_forward(**buffers)
        raise _DeliberateFailure("the conformance kit fails this capture on purpose")

    stream = ctx.platform.new_stream()
    with torch.no_grad(), backend.capture_session(stream):
        graph_forward(**buffers)  # warm-up, as the runner does before each capture
        try:
            backend.capture_one(key, failing)
        except Exception:  # the deliberate failure, or a backend's wrapper around it
            pass
        else:
            raise CheckFailed("capture_one() returned normally although the forward it captured raised")
        if backend.has_shape(key) or key in backend.captured_keys():
            raise CheckFailed(
                f"after a failed capture_one({key}) the key is still held (has_shape "
                f"{backend.has_shape(key)}, captured_keys {[str(k) for k in backend.captured_keys()]}): "
                "a failed capture must leave nothing of its key behind"
            )
        problem = _replay_raises(backend, key, buffers)
        if problem:
            raise CheckFailed(f"replay() of a key whose capture failed {problem}; it must raise ReplayError")
        try:
            backend.capture_one(key, lambda: graph_forward(**buffers))
        except Exception as exc:
            raise CheckFailed(
                f"capturing {key} again after a failed capture raised {type(exc).__name__}: {exc}; nothing "
                "of a failed capture may be reused (its graph, or a memory pool no graph holds any more)"
            ) from exc
    x = ctx.randn(size, WIDTH, seed=62)
    buffers["x"].copy_(x)
    with backend.runtime_session():
        out = backend.replay(key, buffers)
    ctx.assert_exact(out, forward(x), "replay of a key captured after a failed capture")
    backend.cleanup()
    return f"a failed capture of {key} left nothing behind; the key captured again"


def check_cleanup(ctx: KitContext) -> str:
    """``release(key)`` drops one graph; ``close()``/``cleanup()`` drop every graph and output (weak
    references die, reserved memory falls, nothing replays afterwards) and the backend captures again."""
    platform = ctx.platform
    gc.collect()
    ctx.synchronize()
    platform.empty_cache()
    before = platform.reserved_bytes()
    model = kit_model(ctx)
    backend = ctx.new_backend()
    runner = reference_runner(ctx, model, backend=backend)
    runner.capture()
    ctx.synchronize()
    held = platform.reserved_bytes()
    keys = runner.schedule.keys()
    blocks = free_blocks(model, seed=9)
    refs = [weakref.ref(runner.run(**_batch(model, blocks[:s], seed=s))) for s in ctx.sizes]
    if any(r() is None for r in refs):
        raise CheckFailed(
            "a replay output died while the runner was open: outputs must be owned by the graph"
        )
    buffers = dict(runner.static_inputs)
    released = ""
    if backend.supports_release:
        victim = min(keys, key=GraphKey.sort_key)
        backend.release(victim)
        problem = _replay_raises(backend, victim, buffers)
        if backend.has_shape(victim) or victim in backend.captured_keys() or problem:
            raise CheckFailed(
                f"after release({victim}) the key is still held (has_shape {backend.has_shape(victim)}, "
                f"replay {problem or 'raised ReplayError'})"
            )
        batch = _batch(model, blocks[: victim.tokens], seed=91)
        result = runner.verify(**batch)
        if result.replayed or not result.ok:
            raise CheckFailed(f"a step of the released key {victim} did not fall back to a correct eager run")
        released = f"release({victim}) dropped one graph; "
    runner.close()
    gc.collect()
    ctx.synchronize()
    platform.empty_cache()
    after = platform.reserved_bytes()
    held_keys = {str(k) for k in keys if backend.has_shape(k)} | {str(k) for k in backend.captured_keys()}
    if held_keys:
        raise CheckFailed(
            f"after close() (cleanup()) keys {sorted(held_keys)} are still held: cleanup drops every graph"
        )
    for key in keys:
        problem = _replay_raises(backend, key, buffers)
        if problem:
            raise CheckFailed(
                f"after close() (cleanup()) replay({key}) {problem}: cleanup must drop every graph"
            )
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
    again = reference_runner(ctx, model, backend=backend)
    try:
        again.capture()
    except DevGraphError as exc:
        raise CheckFailed(f"capturing again with the backend after cleanup() failed: {exc}") from exc
    result = again.verify(**_batch(model, blocks[: ctx.sizes[-1]], seed=92))
    if not (result.replayed and result.max_abs_diff <= ctx.options.exact_atol):
        raise CheckFailed("the backend did not capture and replay correctly after cleanup()")
    memory = (
        f"reserved {before} -> {held} -> {after} bytes"
        if held > before
        else "platform reports no graph memory growth; checked outputs only"
    )
    return f"{released}outputs released; {memory}; re-capture works"


def check_capture_errors(ctx: KitContext) -> str:
    """A host sync in the captured forward fails capture with a ``CaptureError`` naming the key; keys
    captured before it are released; the device captures fine afterwards. Skipped only on a platform that
    says it cannot detect host syncs (``GraphPlatform.detects_host_sync`` False)."""
    sizes = ctx.sizes
    fail_size = sizes[1]  # not the largest: a graph is captured before the failure
    backend = ctx.new_backend()
    runner = ctx.runner(sync_forward(fail_size), feature_input(), backend=backend)
    keys = runner.schedule.keys()
    try:
        runner.capture()
    except CaptureError as exc:
        message = str(exc)
        key = getattr(exc, "key", None)
        if (
            exc.size != fail_size
            or (key is not None and key.tokens != fail_size)
            or str(fail_size) not in message
        ):
            raise CheckFailed(
                f"CaptureError must name the failing size {fail_size}: size={exc.size!r}, key={key}, "
                f"message {message!r}"
            ) from exc
        error = message
    except Exception as exc:
        raise CheckFailed(
            f"a failed capture raised {type(exc).__name__} ({exc}), not devgraph.CaptureError "
            "(the runner wraps errors; the platform's translate_capture_error may add advice)"
        ) from exc
    else:
        if ctx.detects_host_sync:
            raise CheckFailed(
                f"platform {ctx.platform.name} detects host syncs during capture, yet capturing a forward "
                f"that calls .item() at size {fail_size} succeeded: the backend swallowed the CaptureError "
                "or captured that size eagerly"
            )
        note = (
            f"platform {ctx.platform.name} says it does not detect host syncs during capture "
            "(detects_host_sync is False) and capture succeeded; the check of capture errors does not apply"
        )
        if ctx.options.require_sync_detection:
            raise CheckFailed(note)
        raise CheckSkipped(note)
    left = [str(k) for k in keys if backend.has_shape(k)]
    if left or backend.captured_keys():
        raise CheckFailed(
            f"after a failed capture, keys {left or [str(k) for k in backend.captured_keys()]} are still "
            "captured; the runner releases every graph captured so far"
        )
    weight = ctx.randn(WIDTH, WIDTH, seed=31)
    clean = ctx.runner(lambda x: torch.relu(x @ weight), feature_input())
    clean.capture()
    x = ctx.randn(sizes[-1], WIDTH, seed=32)
    ctx.assert_exact(clean.run(x=x), torch.relu(x @ weight), "a capture after a failed one")
    return error.splitlines()[0][:200]


def check_ownership(ctx: KitContext) -> str:
    """A backend serves one live runner: a second runner given it is refused until the first closes."""
    weight = ctx.randn(WIDTH, WIDTH, seed=81)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x @ weight

    backend = ctx.new_backend()
    first = ctx.runner(forward, feature_input(), backend=backend)
    first.capture()
    try:
        ctx.runner(forward, feature_input(), backend=backend)
    except DevGraphError:
        pass
    else:
        raise CheckFailed(
            "a second runner accepted a backend that belongs to a live runner; its failed capture or "
            "close() would wipe the first runner's graphs (bind() must refuse a second owner)"
        )
    x = ctx.randn(ctx.sizes[-1], WIDTH, seed=82)
    ctx.assert_exact(first.run(x=x), forward(x), "the first runner after a second was refused")
    first.close()
    second = ctx.runner(forward, feature_input(), backend=backend)
    second.capture()
    result = second.verify(x=x)
    if not (result.replayed and result.ok):
        raise CheckFailed(
            "a runner given the backend of a closed runner did not capture and replay correctly"
        )
    return "a second live owner was refused; the backend served a new runner after close()"
