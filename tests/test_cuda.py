"""The CUDA backends (``full``, ``breakable``, ``tc_piecewise``) on a real NVIDIA GPU.

Every test is marked ``cuda``; tests/conftest.py skips them where no NVIDIA GPU is visible. The model is
the reference decoder with Qwen3-0.6B's layer shapes, cut to 4 layers and a 4096-token vocabulary so the
suite runs in a few minutes, in bf16 as served, over a paged KV cache. ``paged`` attention runs the
device-metadata kernels (Triton where it imports) and is captured whole; ``sdpa`` attention is a break op
fed host lengths through the forward context (the break-op modes run it eagerly between segments).

Equality with eager is exact (``max_abs_diff == 0``) whenever the graph and eager run the same kernels on
the same shapes: ``GraphRunner.verify`` compares against eager on the runner's own padded buffers, so any
difference is a capture/replay bug. Against eager on the caller's ``n`` rows (``max_abs_diff_unpadded``) a
padded step may round differently, because cuBLAS may pick another kernel for another row count; that is
judged against a bf16 tolerance.
"""

from __future__ import annotations

import gc
import json
import os
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import chained_breaks

import devgraph
from devgraph import CaptureError, GraphKey, GraphRunner, StaticInput, graph_break
from devgraph.contract.keys import REQUESTS
from devgraph.reference import (
    ReferenceConfig,
    ReferenceModel,
    batch_context,
    decode_runner,
    make_decode_batch,
    make_prefill_batch,
    make_verify_batch,
    prefill_runner,
    reference_inputs,
    verify_runner,
)
from devgraph.reference.kernels import available_backends
from devgraph.strategies.segments import BreakCall, SegmentedPlan

pytestmark = pytest.mark.cuda

STRATEGIES = ["full", "breakable", "tc_piecewise"]
DECODE_SIZES = [1, 2, 4, 8, 16]
PREFILL_SIZES = [16, 64, 128]
#: bf16 bound on |graph - eager(n rows)| relative to max |eager| for padded steps (see the module docstring).
UNPADDED_RTOL = 2e-2
# DEVGRAPH_TEST_DEVICE=cpu runs the file's logic on the simulated graphs, to debug it without a GPU.
DEVICE = torch.device(os.environ.get("DEVGRAPH_TEST_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"
#: Inductor's fused code against the plain forward, as relative L2 error of the logits: inductor keeps
#: float32 between the ops it fuses where eager rounds each op to bf16 (1.7-1.8% on the CPU, 4 layers).
COMPILED_REL_L2 = 4e-2
#: The compiler of the inductor test (DEVGRAPH_TEST_COMPILER=eager: its logic without inductor).
INDUCTOR_TEST_COMPILER = os.environ.get("DEVGRAPH_TEST_COMPILER", "inductor")


# -- fixtures and helpers ------------------------------------------------------------------------------
def _build(attention: str) -> ReferenceModel:
    """Qwen3-0.6B layer shapes, 4 layers, bf16, a random KV-cache history."""
    config = ReferenceConfig.preset(
        "qwen3-0.6b", num_layers=4, vocab_size=4096, max_requests=64, max_seq_len=512, attention=attention
    )
    model = ReferenceModel(config, device=DEVICE, seed=0)
    model.randomize_cache(seed=0)
    _prime_capture_stream(model)
    return model


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    """``paged`` attention: device-metadata kernels, captured whole."""
    return _build("paged")


@pytest.fixture(scope="module")
def sdpa_model() -> ReferenceModel:
    """``sdpa`` attention: one break op per layer, reading host lengths from the context."""
    return _build("sdpa")


def _model_for(request: pytest.FixtureRequest, attention: str) -> ReferenceModel:
    return request.getfixturevalue("model" if attention == "paged" else "sdpa_model")


def _prime_capture_stream(model: ReferenceModel) -> None:
    """Run once on devgraph's capture stream, so lazily created per-stream state (the cuBLAS/cuBLASLt
    workspaces, kept until exit; Triton's compiled kernels) exists before any test measures memory."""
    platform = devgraph.resolve_platform(DEVICE)
    batch = make_decode_batch(model, 8)
    prefill = make_prefill_batch(model, [16, 9])
    context = batch_context(batch) if model.config.attention == "sdpa" else None
    with platform.stream(platform.new_stream()), devgraph.forward_context(context):
        model.decode_step(**batch)
    with platform.stream(platform.new_stream()), devgraph.forward_context(batch_context(prefill)):
        model.prefill_step(**prefill)
    model.decode_step(**batch)
    platform.synchronize()


@pytest.fixture(autouse=True)
def _fresh_compile_state() -> Iterator[None]:
    """Each test compiles from scratch: dynamo's per-code-object cache would otherwise fill up across the
    tests that compile ``model.decode_step`` and reach its recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    settle()


def settle() -> None:
    """Finish queued work and return the allocator's unused cache, so reserved bytes mean held bytes."""
    gc.collect()
    if ON_CUDA:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def allocated() -> int:
    return int(torch.cuda.memory_allocated()) if ON_CUDA else 0


def reserved() -> int:
    if ON_CUDA:
        return int(torch.cuda.memory_reserved())
    return devgraph.resolve_platform(DEVICE).reserved_bytes()


def assert_released(base_allocated: int, base_reserved: int, held: int | None = None) -> None:
    """Device memory is back where it was. The slack is one small allocation (and the 2 MiB segment it sits
    in) that something outside devgraph may keep, e.g. a cached alias of a static buffer; graph pools are
    tens of MiB here, so a leaked pool still fails."""
    settle()
    left_allocated, left_reserved = allocated() - base_allocated, reserved() - base_reserved
    assert left_allocated <= 64 << 10, f"{left_allocated} bytes still allocated"
    assert left_reserved <= 2 << 20, f"{left_reserved} bytes still reserved"
    if held is not None:
        assert left_reserved < held / 10, (left_reserved, held)


def graphs_of(runner: GraphRunner) -> list[Any]:
    """Every device graph a runner's backend holds (one per key, or one per segment)."""
    out = []
    for entry in runner.backend._entries.values():
        if isinstance(entry, SegmentedPlan):
            out += [s for s in entry.steps if not isinstance(s, BreakCall)]
        else:
            out.append(entry.graph)
    return out


def _context(mode: str, batch: dict[str, torch.Tensor]) -> Any:
    """``full`` bakes the capture-time context (none) into the graph, so it runs without one; the
    break-op modes read the live one."""
    return None if mode == "full" else batch_context(batch)


# -- equality with eager -------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["paged", "sdpa"])
@pytest.mark.parametrize("mode", STRATEGIES)
def test_decode_equals_eager_at_every_captured_padded_and_fallback_size(request, mode, attention):
    model = _model_for(request, attention)
    with decode_runner(model, mode=mode, sizes=DECODE_SIZES) as runner:
        runner.capture()
        assert [k.tokens for k in runner.keys] == DECODE_SIZES
        for n in (1, 2, 3, 4, 5, 8, 13, 16, 17, 24):
            batch = make_decode_batch(model, n, seed=n)
            result = runner.verify(n, _context(mode, batch), **batch)
            assert result.replayed == (n <= 16), (mode, n)
            assert result.size == runner.bucket(n)
            assert result.max_abs_diff == 0.0, (mode, n, result)
            assert result.max_abs_diff_unpadded <= UNPADDED_RTOL * result.scale, (mode, n, result)
        if mode == "tc_piecewise":  # compiled once for every size; nothing recompiled at run time
            assert (runner.inspect()["compiles"], runner.inspect()["recompiles"]) == (1, 0)


@pytest.mark.parametrize("attention", ["paged", "sdpa"])
@pytest.mark.parametrize("mode", STRATEGIES)
def test_prefill_equals_eager_packed_requests(request, mode, attention):
    model = _model_for(request, attention)
    with prefill_runner(model, mode=mode, sizes=PREFILL_SIZES) as runner:
        runner.capture()
        for lens in ([16], [5, 9], [20, 12], [30, 34], [64, 64], [100, 40], [7] * 12):
            prefixes = [(37 * r) % 200 for r in range(len(lens))]
            batch = make_prefill_batch(model, lens, prefix_lens=prefixes, seed=len(lens))
            result = runner.verify(sum(lens), _context(mode, batch), **batch)
            assert result.replayed == (sum(lens) <= 128), (mode, lens)
            assert result.max_abs_diff == 0.0, (mode, lens, result)
            assert result.max_abs_diff_unpadded <= UNPADDED_RTOL * result.scale, (mode, lens, result)


@pytest.mark.parametrize("mode", STRATEGIES)
def test_eager_fallback_past_the_largest_size(model, mode):
    with decode_runner(model, mode=mode, sizes=[1, 2, 4]) as runner:
        runner.capture()
        batch = make_decode_batch(model, 9, seed=3)
        assert runner.bucket(9) is None
        out = runner.run(9, None, **batch).clone()
        torch.testing.assert_close(out, model.decode_step(**batch), rtol=0, atol=0)
        # A captured size still replays afterwards.
        assert runner.verify(3, None, **make_decode_batch(model, 3)).max_abs_diff == 0.0


# -- full graphs over the paged kernels: any batch composition of one key --------------------------------
def test_paged_full_decode_replays_any_batch_composition(model):
    """One decode graph per key replays every batch that pads to it: the kernels read block tables and
    lengths from device memory, so nothing of the capture-time batch is baked in."""
    rng = random.Random(0)
    with decode_runner(model, mode="full", sizes=[8, 32]) as runner:
        runner.capture()
        for step in range(24):
            n = rng.randint(17, 32) if step % 2 else rng.randint(1, 8)
            lens = [rng.choice([1, 15, 16, 17, rng.randint(1, 512)]) for _ in range(n)]
            batch = make_decode_batch(model, n, seq_lens=lens, seed=step)
            result = runner.verify(n, None, **batch)
            assert result.key == GraphKey.of(8 if n <= 8 else 32, {REQUESTS: 8 if n <= 8 else 32})
            assert result.max_abs_diff == 0.0, (n, lens, result)
            assert result.max_abs_diff_unpadded <= UNPADDED_RTOL * result.scale, (n, result)


def test_paged_full_packed_prefill_replays_any_batch_composition(model):
    """Packed multi-request prefill under ``full``: one graph per key (128 tokens, up to 8 requests)
    replays any split into requests, fresh prompts and later chunks alike."""
    rng = random.Random(1)
    with prefill_runner(model, mode="full", sizes=[64, 128], axes={REQUESTS: 8}) as runner:
        runner.capture()
        assert GraphKey.of(128, {REQUESTS: 8}) in runner.keys
        for step in range(24):
            requests = rng.randint(1, 8)
            total = rng.randint(max(65, requests), 128)
            cuts = sorted(rng.sample(range(1, total), requests - 1))
            lens = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
            prefixes = [rng.choice([0, 0, rng.randint(1, 512 - q)]) for q in lens]
            batch = make_prefill_batch(model, lens, prefix_lens=prefixes, seed=step)
            result = runner.verify(total, None, **batch)
            assert result.key == GraphKey.of(128, {REQUESTS: 8}), (lens, result.key)
            assert result.max_abs_diff == 0.0, (lens, prefixes, result)
            assert result.max_abs_diff_unpadded <= UNPADDED_RTOL * result.scale, (lens, result)


def test_paged_full_verify_k3_replays_any_batch_composition(model):
    """Speculative-decoding verify steps, 1 + 3 tokens per request, under ``full``."""
    rng = random.Random(2)
    with verify_runner(model, 4, mode="full", sizes=[16, 32]) as runner:
        runner.capture()
        assert runner.keys == [GraphKey.of(16, {REQUESTS: 4}), GraphKey.of(32, {REQUESTS: 8})]
        for step in range(16):
            requests = rng.randint(1, 8)
            batch = make_verify_batch(model, requests, 4, seed=step)
            result = runner.verify(4 * requests, None, **batch)
            assert result.replayed and result.max_abs_diff == 0.0, (requests, result)
            assert result.max_abs_diff_unpadded <= UNPADDED_RTOL * result.scale, (requests, result)


# Two of the four pairings (each an inductor compile of tens of seconds; the CUDA suite must fit a ten-minute
# call): every mode and every attention op are covered once.
@pytest.mark.parametrize(("mode", "attention"), [("full", "paged"), ("tc_piecewise", "sdpa")])
def test_inductor_compiles_around_the_attention_ops(request, mode, attention):
    """The attention ops take the step's paged metadata as one ``Tensor?[]`` argument
    (``PagedMetadata.tensors()``): inductor keeps each op opaque, the graphs replay what the compiled
    forward computes, and that is the plain forward's result up to bf16 rounding (COMPILED_REL_L2), with
    nothing recompiled."""
    model = _model_for(request, attention)
    flag = {"decode": {"backend": mode, "compiler": INDUCTOR_TEST_COMPILER, "sizes": [1, 4, 8]}}
    with decode_runner(model, config=json.dumps(flag)) as runner:
        runner.capture()
        for n in (1, 3, 8):
            batch = make_decode_batch(model, n, seed=n)
            context = _context(mode, batch)
            result = runner.verify(n, context, **batch)
            assert result.replayed and result.max_abs_diff == 0.0, (mode, n, result)
            out = runner.run(n, context, copy=True, **batch).float()
            with devgraph.forward_context(batch_context(batch)):
                plain = model.decode_step(**batch).float()  # rewrites the same K/V at the same slots
            error = float((out - plain).norm() / plain.norm())
            assert error <= COMPILED_REL_L2, (mode, n, error)
        assert runner.inspect()["recompiles"] == 0


def test_paged_attention_runs_the_triton_kernels_on_the_gpu():
    """The premise of the tests above on a GPU: ``kernels="auto"`` picks Triton when it imports."""
    if not ON_CUDA:
        pytest.skip("the Triton kernels need a GPU")
    assert "triton" in available_backends(), "triton does not import on this GPU machine"


# -- conformance: a stale input is caught --------------------------------------------------------------
@pytest.mark.parametrize("mode", STRATEGIES)
def test_stale_input_outside_the_static_buffers_is_caught_by_verify(model, mode):
    """A forward that reads a tensor the runner does not stage (here a bias the caller *replaces* after
    capture) replays the capture-time tensor. ``verify`` runs eager on the same padded batch, so the
    difference shows up as a non-zero ``max_abs_diff``: the check every backend is held to."""
    state = {"bias": torch.zeros(model.config.vocab_size, dtype=model.config.dtype, device=DEVICE)}

    def forward(**batch: torch.Tensor) -> torch.Tensor:
        return model.decode_step(**batch) + state["bias"]

    # The address guard would name the replaced bias before verify() compares anything (tests/test_guard.py).
    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=reference_inputs(model),
        sizes=[2, 4],
        device=DEVICE,
        mode=mode,
        address_guard=False,
    )
    with runner:
        runner.capture()
        batch = make_decode_batch(model, 4, seed=1)
        assert runner.verify(4, None, **batch).max_abs_diff == 0.0
        state["bias"] = torch.full_like(state["bias"], 4.0)  # a new tensor: the graphs still read the old one
        stale = runner.verify(4, None, **batch)
        assert stale.replayed and not stale.ok
        assert stale.max_abs_diff >= 3.0, stale


# -- capture failures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", STRATEGIES)
def test_capture_failure_names_the_size_and_releases_everything(model, mode):
    """``.item()`` (a host sync) at batch size 4 only: sizes 16 and 8 capture, 4 fails; the error names
    the key of size 4 and nothing captured survives, in the backend or in device memory."""

    def forward(**batch: torch.Tensor) -> torch.Tensor:
        logits = model.decode_step(**batch)
        if batch["input_ids"].shape[0] == 4:
            logits = logits + logits[0, 0].item()
        return logits

    runner = GraphRunner(
        forward,
        phase="decode",
        inputs=reference_inputs(model),
        sizes=[1, 2, 4, 8, 16],
        device=DEVICE,
        mode=mode,
    )
    settle()
    base_allocated, base_reserved = allocated(), reserved()
    with pytest.raises(CaptureError) as info:
        runner.capture()
    error = info.value
    assert error.size == 4
    assert "tokens=4" in str(error) and "graph_break" in str(error), str(error)
    assert runner.backend.captured_keys() == []
    del info, error  # the traceback holds the failed capture's tensors
    assert_released(base_allocated, base_reserved)
    # The runner still serves steps (eagerly) and the device is healthy.
    batch = make_decode_batch(model, 2)
    torch.testing.assert_close(runner.run(2, None, **batch), forward(**batch))
    runner.close()


@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_out_of_memory_during_capture_gives_advice(model, mode):
    """An allocation the device cannot hold, made only while capturing size 4."""

    def forward(**batch: torch.Tensor) -> torch.Tensor:
        if devgraph.is_capturing() and batch["input_ids"].shape[0] == 4:
            torch.empty(1 << 42, dtype=torch.uint8, device=DEVICE)  # 4 TiB
        return model.decode_step(**batch)

    runner = GraphRunner(
        forward, phase="decode", inputs=reference_inputs(model), sizes=[2, 4, 8], device=DEVICE, mode=mode
    )
    settle()
    base_allocated, base_reserved = allocated(), reserved()
    with pytest.raises(CaptureError) as info:
        runner.capture()
    message = str(info.value)
    assert info.value.size == 4
    assert "out of memory" in message and "max_size" in message and "decode=disabled" in message
    assert runner.backend.captured_keys() == []
    del info
    assert_released(base_allocated, base_reserved)
    runner.close()


# -- memory --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", STRATEGIES)
def test_close_returns_the_graph_memory(model, mode):
    settle()
    base_allocated, base_reserved = allocated(), reserved()
    runner = decode_runner(model, mode=mode, sizes=[1, 8, 32, 64])
    report = runner.capture()
    batch = make_decode_batch(model, 32)
    runner.run(32, None, **batch)
    settle()
    held = reserved() - base_reserved
    assert report.bytes > 0 and held >= report.bytes // 2, (report.bytes, held)
    runner.close()
    assert_released(base_allocated, base_reserved, held)


def _prefill_graph_memory(model: ReferenceModel, mode: str, sizes: list[int]) -> tuple[int, GraphRunner]:
    """Reserved-memory growth across capture (after empty_cache) and the captured runner."""
    settle()
    base = reserved()
    runner = prefill_runner(model, mode=mode, sizes=sizes, axes={REQUESTS: 4})
    runner.capture()
    settle()
    return reserved() - base, runner


def test_break_op_graph_memory_is_shared_across_sizes(sdpa_model):
    """Break-op tensors live in the shared graph pool and are reused by every size, so the break-op modes
    hold about what ``full`` holds for the same prefill sizes (each size keeping its own break-op tensors
    cost 9.3 x); ``close()`` gives all of it back."""
    sizes = [64, 128, 256, 512]
    held: dict[str, int] = {}
    for mode in STRATEGIES:
        settle()
        base_allocated, base_reserved = allocated(), reserved()
        held[mode], runner = _prefill_graph_memory(sdpa_model, mode, sizes)
        batch = make_prefill_batch(sdpa_model, [200, 100])
        assert runner.verify(300, _context(mode, batch), **batch).max_abs_diff == 0.0
        runner.close()
        assert_released(base_allocated, base_reserved, held[mode])
    assert held["full"] > 0, held
    for mode in ("breakable", "tc_piecewise"):
        assert held[mode] <= 1.25 * held["full"], (mode, {m: b / 2**20 for m, b in held.items()})


# -- break ops -----------------------------------------------------------------------------------------
@graph_break("devgraph_test_cuda::scale_by_context")
def scale_by_context(x: torch.Tensor) -> torch.Tensor:
    """Multiplies by the live context's ``scale`` (a host float that changes per step)."""
    context = devgraph.get_forward_context()
    return x * (context.scale if context is not None else 1.0)


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return scale_by_context(torch.sin(x) + 1.0) * 2.0


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_break_ops_read_the_live_forward_context(mode):
    runner = GraphRunner(
        _scaled,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (64,))},
        sizes=[2, 4, 8],
        device=DEVICE,
        mode=mode,
    )
    with runner:
        runner.capture()
        gen = torch.Generator().manual_seed(0)
        for n, scale in ((8, 3.0), (3, 0.5), (8, -2.0), (1, 7.0), (6, 1.0)):
            x = torch.randn(n, 64, generator=gen).to(DEVICE)
            out = runner.run(n, SimpleNamespace(scale=scale), x=x)
            torch.testing.assert_close(out, (torch.sin(x) + 1.0) * scale * 2.0)


def test_full_bakes_the_capture_time_context_into_the_graph():
    """The counterpart: ``full`` captures the break op's kernels, so a per-step host value is frozen at
    its capture-time value (no context: 1.0). Host state that changes per step needs a break-op mode."""
    runner = GraphRunner(
        _scaled,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (64,))},
        sizes=[4],
        device=DEVICE,
        mode="full",
    )
    with runner:
        runner.capture()
        x = torch.randn(4, 64).to(DEVICE)
        out = runner.run(4, SimpleNamespace(scale=3.0), x=x)
        torch.testing.assert_close(out, (torch.sin(x) + 1.0) * 2.0)


def _replay_in_random_orders(runner: GraphRunner, steps: dict[int, tuple[Any, dict[str, Any]]]) -> None:
    order = list(steps)
    rng = random.Random(0)
    for _ in range(6):
        rng.shuffle(order)
        for n in order:
            context, batch = steps[n]
            result = runner.verify(n, context, **batch)
            assert result.max_abs_diff == 0.0, (order, n, result)
            assert result.max_abs_diff_unpadded <= UNPADDED_RTOL * max(result.scale, 1.0), (order, n, result)


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_break_op_aliases_replay_exactly_in_any_size_order(mode):
    """Break-op arguments and outputs are weak aliases into the graph pool that other sizes reuse once
    dead: replaying sizes in random orders, interleaved with eager steps, must stay exact."""
    runner = GraphRunner(
        chained_breaks,
        phase="prefill",
        mode=mode,
        sizes=[16, 64, 256, 1024],
        device=DEVICE,
        inputs={"x": StaticInput(torch.float32, (256,)), "bias": StaticInput(torch.float32, (256,))},
    )
    with runner:
        runner.capture()
        gen = torch.Generator().manual_seed(0)
        steps: dict[int, tuple[Any, dict[str, Any]]] = {}
        for n in (3, 16, 40, 64, 200, 256, 700, 1024, 1500):
            x, bias = (torch.randn(n, 256, generator=gen).to(DEVICE) for _ in range(2))
            steps[n] = (None, {"x": x, "bias": bias})
        _replay_in_random_orders(runner, steps)


@pytest.mark.parametrize("mode", ["breakable", "tc_piecewise"])
def test_reference_break_ops_replay_exactly_in_any_size_order(sdpa_model, mode):
    with prefill_runner(sdpa_model, mode=mode, sizes=[32, 64, 128, 256], axes={REQUESTS: 8}) as runner:
        runner.capture()
        steps = {}
        for lens in ([5], [20, 12], [30, 34, 1], [100, 28], [64, 64, 64, 50], [300]):
            batch = make_prefill_batch(sdpa_model, lens, seed=len(lens))
            steps[sum(lens)] = (batch_context(batch), batch)
        _replay_in_random_orders(runner, steps)
    with decode_runner(sdpa_model, mode=mode, sizes=DECODE_SIZES) as runner:
        runner.capture()
        steps = {}
        for n in (1, 3, 8, 13, 16, 20):
            batch = make_decode_batch(sdpa_model, n, seed=n)
            steps[n] = (batch_context(batch), batch)
        _replay_in_random_orders(runner, steps)


# -- capture-time behaviour ----------------------------------------------------------------------------
@graph_break("devgraph_test_cuda::probe")
def probe(x: torch.Tensor) -> torch.Tensor:
    """Records what the eager side of a capture looks like: size, stream, gc state."""
    platform = devgraph.resolve_platform(x.device)
    PROBES.append((x.shape[0], platform.current_stream(), gc.get_freeze_count() > 0))
    return x * 1.0


PROBES: list[tuple[int, Any, bool]] = []


def _probed(x: torch.Tensor) -> torch.Tensor:
    return probe(torch.cos(x)) + 1.0


@pytest.mark.parametrize("mode", STRATEGIES)
def test_capture_is_largest_first_on_one_stream_and_pool_with_gc_frozen_and_a_report(mode, capsys):
    sizes = [1, 2, 4, 8]
    runner = GraphRunner(
        _probed,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (32,))},
        sizes=sizes,
        device=DEVICE,
        mode=mode,
        progress=True,
    )
    platform = runner.platform
    PROBES.clear()
    with runner:
        report = runner.capture()
        seen = list(PROBES)
        # Warm-ups and the capture itself, largest size first.
        per_size = runner.warmup_iters + 1
        # With a single warm-up the first key runs once more: the state probe needs two runs of the forward
        # (it checks that the forward moves only what it declares) and the backend's own run precedes capture.
        first = [sizes[-1]] if runner.warmup_iters == 1 else []
        expected = first + [s for s in reversed(sizes) for _ in range(per_size)]
        assert [size for size, _, _ in seen] == expected
        capture_stream = seen[0][1]
        assert all(stream == capture_stream for _, stream, _ in seen), "warm-up and capture left the stream"
        assert capture_stream != platform.current_stream(), "captured on the stream the engine runs on"
        if ON_CUDA:  # one capture stream for the process (its cuBLAS workspace is allocated once)
            assert capture_stream == platform.new_stream()
        assert all(frozen for _, _, frozen in seen), "gc was not frozen during capture"
        assert gc.get_freeze_count() == 0
        pools = {g.pool() for g in graphs_of(runner)} if ON_CUDA else {None}
        assert len(pools) == 1, "sizes were captured into more than one pool"
        assert [s.size for s in report.sizes] == sizes
        assert all(s.seconds > 0 for s in report.sizes) and report.seconds > 0
        assert report.bytes > 0
        assert f"{report.backend} on {report.platform}" in report.table()
        assert f"capturing decode ({mode})" in capsys.readouterr().err
        x = torch.randn(3, 32).to(DEVICE)
        torch.testing.assert_close(runner.run(3, None, x=x), torch.cos(x) + 1.0)


# -- the plug-in -------------------------------------------------------------------------------------
def test_cuda_platform_backends_and_defaults():
    platform = devgraph.resolve_platform(DEVICE)
    if not ON_CUDA:
        pytest.skip("platform checks need the GPU")
    assert platform.name == "cuda" and platform.availability()
    assert "CUDA" in platform.describe()
    for phase in devgraph.Phase:
        assert devgraph.create_backend(DEVICE, phase.value, "auto").name == phase.spec.default_mode
    for mode in STRATEGIES:
        backend = devgraph.create_backend(DEVICE, "prefill", mode)
        assert type(backend).__module__ == "devgraph_cuda.backends"
    free, total = platform.mem_get_info()
    assert 0 < free <= total
