"""The reference vision encoder and its lazily capturing runner: any image split of a token bucket
replays exactly, the graph cache is bounded and gives memory back, statistics are exact."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from devgraph.contract.context import capturing, forward_context
from devgraph.errors import CaptureError, ConfigError
from devgraph.reference.encoder import (
    EncoderContext,
    ImageBatch,
    VisionConfig,
    VisionEncoder,
    encode,
    encoder_runner,
    encoder_sizes,
    image_positions,
    make_image_batch,
)
from devgraph.runner.graph_runner import GraphRunner

Grids = Sequence[tuple[int, int]]

# Several splits of one token count into images (grids in patches, sides multiples of 2).
SPLITS_128: list[list[tuple[int, int]]] = [
    [(8, 16)],
    [(8, 8), (8, 8)],
    [(4, 4)] * 8,
    [(2, 64)],
    [(4, 8), (12, 8)],
]
# 100 patches: padded up to the 128 bucket.
SPLITS_100: list[list[tuple[int, int]]] = [
    [(10, 10)],
    [(2, 50)],
    [(6, 6), (8, 8)],
    [(4, 4)] * 6 + [(2, 2)],
]
# float32 on the CPU: only summation order may differ (a padded GEMM, a different T in the reference).
EXACT: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}
MODES = [("full", "varlen"), ("breakable", "sdpa"), ("full", "sdpa")]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny encoder's ops are too small for two threads to help; on a shared 2-core machine a second
    thread only waits. Restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_encoder(attention: str = "varlen", *, device: str = "cpu", **overrides: object) -> VisionEncoder:
    return VisionEncoder(VisionConfig.preset("tiny", attention=attention, **overrides), device=device, seed=0)


def encode_eagerly(model: VisionEncoder, batch: ImageBatch) -> torch.Tensor:
    with torch.no_grad(), forward_context(batch.context):
        return model(**batch.inputs)


def check_step(runner: GraphRunner, model: VisionEncoder, grids: Grids, seed: int) -> None:
    batch = make_image_batch(model, grids, seed=seed)
    out = encode(runner, batch, copy=True)
    assert out.shape == (batch.merged_tokens, model.config.out_hidden_size)
    torch.testing.assert_close(out, encode_eagerly(model, batch), **EXACT)


# -- the model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
@pytest.mark.parametrize("window", [0, 2])
def test_packed_images_equal_each_image_encoded_alone(attention: str, window: int) -> None:
    model = tiny_encoder(attention, window_size=window, full_attention_blocks=(1,) if window else ())
    grids = [(4, 6), (8, 10), (2, 2)]
    packed = make_image_batch(model, grids, seed=3)
    merged = encode_eagerly(model, packed)
    start = 0
    bounds = packed.context.cu_seqlens
    assert bounds is not None
    for i, grid in enumerate(grids):
        begin, end = bounds[i], bounds[i + 1]
        alone = make_image_batch(model, [grid], patches=packed.inputs["patches"][begin:end])
        rows = (end - begin) // 4
        torch.testing.assert_close(merged[start : start + rows], encode_eagerly(model, alone), **EXACT)
        start += rows
    assert start == merged.shape[0] == packed.merged_tokens


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_windowed_blocks_attend_within_windows(attention: str) -> None:
    """A windowed encoder with no full-attention block equals the plain encoder run on the same patches
    put in window order with each window as an image, then put back in image order."""
    windowed = tiny_encoder(attention, window_size=2)
    plain = tiny_encoder(attention)
    batch = make_image_batch(windowed, [(8, 8), (4, 12), (2, 2)], seed=4)
    assert batch.windows == 4 + 3 + 1  # 4x4 merged: 2x2 windows; 2x6: 1x3 windows; 1x1: one
    order = batch.inputs["window_index"]
    patches = batch.inputs["patches"].view(-1, 4, 48).index_select(0, order).view(-1, 48)
    positions = batch.inputs["position_ids"].view(-1, 4, 2).index_select(0, order).view(-1, 2)
    as_images = {
        "patches": patches,
        "position_ids": positions,
        "cu_seqlens": batch.inputs["cu_window_seqlens"],
        "output_order": batch.inputs["output_order"],
    }
    plain.prepare(batch.grids)
    with torch.no_grad(), forward_context(EncoderContext(batch.context.cu_window_seqlens)):
        expected = plain(**as_images)
    got = encode_eagerly(windowed, batch)
    torch.testing.assert_close(got, expected, **EXACT)
    assert not torch.allclose(got, encode_eagerly(plain, make_image_batch(plain, batch.grids, seed=4)))


@pytest.mark.parametrize("window", [0, 2])
def test_host_boundaries_and_device_boundaries_agree(window: int) -> None:
    """The sdpa break op (host boundaries from the context) and the varlen kernel (device tensors)."""
    blocks = (0,) if window else ()
    varlen = tiny_encoder("varlen", window_size=window, full_attention_blocks=blocks)
    sdpa = tiny_encoder("sdpa", window_size=window, full_attention_blocks=blocks)
    batch = make_image_batch(varlen, [(6, 6), (4, 10)], seed=1)
    sdpa.prepare(batch.grids)
    torch.testing.assert_close(encode_eagerly(sdpa, batch), encode_eagerly(varlen, batch), **EXACT)


def test_image_positions_are_in_merge_order() -> None:
    positions = image_positions(4, 4, 2)
    # The first four patches are the top-left 2x2 square, the next four the square to its right.
    assert positions[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert positions.shape == (16, 2)
    assert sorted(map(tuple, positions.tolist())) == [(r, c) for r in range(4) for c in range(4)]


def test_rotary_table_grows_outside_capture_only() -> None:
    model = tiny_encoder()
    assert model.rotary_rows == 0
    make_image_batch(model, [(2, 18)])
    assert model.rotary_rows == 32  # the next power of two above the largest side, 18
    make_image_batch(model, [(4, 4)])
    assert (model.rotary_rows, model.table_growths) == (32, 1)
    with capturing(), pytest.raises(CaptureError, match="during a graph capture"):
        model.ensure_positions(33)
    assert model.rotary_rows == 32


@pytest.mark.parametrize(
    ("grids", "match"),
    [([(3, 4)], "multiples of spatial_merge=2"), ([(4,)], r"\(height, width\)"), ([], "at least one grid")],
)
def test_bad_grids_are_refused(grids: Grids, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_image_batch(tiny_encoder(), grids)


def test_config_and_sizes_are_checked() -> None:
    with pytest.raises(ConfigError, match="multiple of num_heads"):
        VisionConfig.preset("tiny", num_heads=5)
    with pytest.raises(ConfigError, match="accepted: varlen, sdpa"):
        VisionConfig.preset("tiny", attention="paged")
    with pytest.raises(ConfigError, match="accepted: tiny, qwen2-vl"):
        VisionConfig.preset("vit-huge")
    assert encoder_sizes(200) == [64, 128, 192, 256]
    with pytest.raises(ConfigError, match="raise step"):
        encoder_sizes(1 << 20)
    with pytest.raises(ConfigError, match="max_images"):
        encoder_runner(tiny_encoder(), max_images=0)


# -- one graph per token bucket, any split ------------------------------------------------------------
@pytest.mark.parametrize(("mode", "attention"), MODES)
@pytest.mark.parametrize("window", [0, 2])
def test_every_split_of_a_bucket_replays_one_graph_exactly(mode: str, attention: str, window: int) -> None:
    model = tiny_encoder(attention, window_size=window, full_attention_blocks=(0,) if window else ())
    with encoder_runner(model, mode=mode, sizes=[64, 128]) as runner:
        runner.capture()
        assert runner.keys == []  # lazy: nothing captured at start-up
        for seed, grids in enumerate(SPLITS_128 + SPLITS_100):
            check_step(runner, model, grids, seed)
        stats = runner.stats()
        steps = len(SPLITS_128) + len(SPLITS_100)
        assert stats["lazy"]["misses"] == 1 and stats["lazy"]["hits"] == steps - 1
        key = "tokens=128,merged=32,requests=8" + (",windows=32" if window else "")
        assert stats["replays_by_key"] == {key: steps}
        assert stats["padded_rows"] == 28 * len(SPLITS_100)
        assert [str(k) for k in runner.keys] == [key]


def test_tc_piecewise_compiles_around_the_sdpa_image_attention() -> None:
    """torch.compile traces the sdpa break op through its shape function, which takes the op's arguments
    (a copy of the signature once missed ``windowed``: the encoder with sdpa attention did not compile)."""
    model = tiny_encoder("sdpa", window_size=2, full_attention_blocks=(0,))
    with encoder_runner(model, mode="tc_piecewise", sizes=[128]) as runner:
        runner.capture()
        for seed, grids in enumerate([SPLITS_128[1], SPLITS_100[2]]):
            check_step(runner, model, grids, seed)
        assert runner.inspect()["recompiles"] == 0


@pytest.mark.parametrize(("mode", "attention"), MODES)
def test_verify_agrees_for_a_padded_windowed_split(mode: str, attention: str) -> None:
    model = tiny_encoder(attention, window_size=2, full_attention_blocks=(1,))
    with encoder_runner(model, mode=mode, sizes=[128]) as runner:
        runner.capture()
        batch = make_image_batch(model, SPLITS_100[2], seed=5)
        result = runner.verify(context=batch.context, **batch.inputs)  # type: ignore[arg-type]
        assert result.ok and result.replayed, result


def test_more_images_or_patches_than_the_graphs_hold_run_eagerly() -> None:
    model = tiny_encoder()
    with encoder_runner(model, sizes=[64, 128], max_images=4) as runner:
        runner.capture()
        check_step(runner, model, [(2, 2)] * 5, seed=1)  # 5 images > 4
        check_step(runner, model, [(12, 12)], seed=2)  # 144 patches > 128
        check_step(runner, model, [(2, 2)] * 4, seed=3)  # fits: captured
        stats = runner.stats()
        assert stats["eager_by_reason"]["axis_past_largest"] == 1
        assert stats["eager_by_reason"]["past_largest"] == 1
        assert (stats["replays"], stats["lazy"]["misses"]) == (1, 1)


# -- the bounded cache -------------------------------------------------------------------------------
def test_least_recently_used_graph_is_evicted_under_max_graphs() -> None:
    model = tiny_encoder()
    with encoder_runner(model, sizes=[64, 128, 192], max_graphs=2) as runner:
        runner.capture()
        order = [(8, 8), (8, 16), (8, 8), (8, 24), (8, 16), (8, 8)]  # 64, 128, 64, 192, 128, 64 patches
        held = []
        for seed, grid in enumerate(order):
            check_step(runner, model, [grid], seed)
            held.append(sorted(k.tokens for k in runner.keys))
        # 192 evicts 128 (64 was used more recently); 128 then evicts 64; 64 evicts 192.
        assert held == [[64], [64, 128], [64, 128], [64, 192], [128, 192], [64, 128]]
        lazy = runner.stats()["lazy"]
        assert (lazy["misses"], lazy["hits"], lazy["evictions"]) == (5, 1, 3)
        assert lazy["capture_seconds"] > 0


def test_graph_byte_bound_keeps_only_the_newest_graph() -> None:
    model = tiny_encoder()
    with encoder_runner(model, sizes=[64, 128, 192], max_graph_bytes=1) as runner:
        runner.capture()
        for seed, grid in enumerate([(8, 8), (8, 16), (8, 24), (8, 16)]):
            check_step(runner, model, [grid], seed)
            assert [k.tokens for k in runner.keys] == [grid[0] * grid[1]]
        lazy = runner.stats()["lazy"]
        assert (lazy["misses"], lazy["hits"], lazy["evictions"]) == (4, 0, 3)


def test_evicted_graph_memory_is_returned_and_never_accumulates() -> None:
    model = tiny_encoder()
    with encoder_runner(model, sizes=[64, 256], max_graphs=1) as runner:
        runner.capture()
        platform = runner.platform
        base = platform.reserved_bytes()
        held = []
        for cycle in range(3):
            for grid in [(16, 16), (8, 8)]:
                check_step(runner, model, [grid], cycle)
                held.append(platform.reserved_bytes() - base)
        large, small = held[0], held[1]
        assert large > small > 0  # the 64-patch graph holds less than the 256-patch one it replaced
        assert held == [large, small] * 3  # each eviction gave everything back
        assert runner.stats()["lazy"]["evictions"] == 5
    assert platform.reserved_bytes() == base


def test_new_sizes_are_captured_while_seen_sizes_replay() -> None:
    model = tiny_encoder()
    with encoder_runner(model, sizes=[64, 128, 192, 256]) as runner:
        runner.capture()
        steps = [
            [(8, 8)],  # 64: new
            [(4, 4), (4, 12)],  # 64: replay, another split
            [(8, 16)],  # 128: new
            [(2, 2)] * 5,  # 20 -> 64: replay
            [(10, 10), (6, 6)],  # 136 -> 192: new
            [(4, 4)] * 8,  # 128: replay
            [(16, 16)],  # 256: new
            [(2, 64), (6, 6)],  # 164 -> 192: replay
            [(8, 8)] * 3,  # 192: replay
        ]
        for seed, grids in enumerate(steps):
            check_step(runner, model, grids, seed)
        stats = runner.stats()
        assert stats["lazy"] | {"capture_seconds": 0} == {
            "hits": 5,
            "misses": 4,
            "evictions": 0,
            "capture_seconds": 0,
        }
        assert stats["replays_by_key"] == {
            "tokens=64,merged=16,requests=8": 3,
            "tokens=128,merged=32,requests=8": 2,
            "tokens=192,merged=48,requests=8": 3,
            "tokens=256,merged=64,requests=8": 1,
        }
        real = sum(h * w for grids in steps for h, w in grids)
        assert (stats["steps"], stats["eager"], stats["real_rows"]) == (9, 0, real)
        assert stats["padded_rows"] == sum([64, 64, 128, 64, 192, 128, 256, 192, 192]) - real


def test_graphs_captured_before_the_table_grew_stay_correct() -> None:
    model = tiny_encoder()
    with encoder_runner(model, sizes=[64, 256]) as runner:
        runner.capture()
        check_step(runner, model, [(8, 8)], seed=0)
        assert model.rotary_rows == 32  # covers every side a 64-patch bucket can hold (64 // 2)
        check_step(runner, model, [(16, 16)], seed=1)
        assert model.rotary_rows == 128  # grew before capturing the 256 bucket
        # The 64 bucket's graph still reads the old table: any image of that bucket, the widest too.
        check_step(runner, model, [(2, 32)], seed=2)
        check_step(runner, model, [(2, 2), (4, 14)], seed=3)
        assert runner.stats()["lazy"]["misses"] == 2


# -- on a GPU -----------------------------------------------------------------------------------------
def gpu_encoder(attention: str = "varlen", window: int = 0) -> VisionEncoder:
    """A small bf16 encoder with head dim 64, so the Triton varlen kernel runs."""
    config = VisionConfig.preset(
        "tiny",
        hidden_size=256,
        num_heads=4,
        intermediate_size=512,
        dtype=torch.bfloat16,
        attention=attention,
        window_size=window,
        full_attention_blocks=(1,) if window else (),
    )
    return VisionEncoder(config, device="cuda", seed=0)


@pytest.mark.cuda
@pytest.mark.parametrize(("mode", "attention"), [("full", "varlen"), ("breakable", "sdpa")])
@pytest.mark.parametrize("window", [0, 2])
def test_cuda_every_split_of_a_bucket_equals_eager(mode: str, attention: str, window: int) -> None:
    model = gpu_encoder(attention, window)
    with encoder_runner(model, mode=mode, sizes=[128, 256]) as runner:
        runner.capture()
        for seed, grids in enumerate(SPLITS_128 + SPLITS_100 + [[(16, 16)], [(8, 8)] * 4]):
            batch = make_image_batch(model, grids, seed=seed)
            out = encode(runner, batch, copy=True)
            torch.testing.assert_close(
                out.float(), encode_eagerly(model, batch).float(), rtol=2e-2, atol=2e-2
            )
            # Against eager on the same padded buffers (same shapes, so the same kernels): identical.
            result = runner.verify(context=batch.context, **batch.inputs)  # type: ignore[arg-type]
            assert result.ok and result.max_abs_diff == 0.0, result
        assert runner.stats()["lazy"]["misses"] == 2


@pytest.mark.cuda
def test_cuda_evicted_graph_memory_is_returned() -> None:
    model = gpu_encoder()
    with encoder_runner(model, sizes=[128, 4096], max_graphs=1) as runner:
        runner.capture()
        held = []
        for cycle in range(4):
            for grid in [(64, 64), (8, 16)]:
                encode(runner, make_image_batch(model, [grid], seed=cycle), copy=True)
                torch.cuda.synchronize()
                held.append(torch.cuda.memory_reserved())
        assert runner.stats()["lazy"]["evictions"] == 7
        large, small = held[2::2], held[3::2]
        # Evicting the 4096-patch graph gives its pool back, every time...
        assert all(a < b for a, b in zip(small, large, strict=True)), held
        # ...and evict/capture cycles do not accumulate memory.
        assert max(held[2:]) <= max(held[:2]), held
