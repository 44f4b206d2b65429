"""Writes into a view of a forward's state stay in place under inductor (devgraph.strategies.inplace).

The zoo's ``plain`` decoder keeps one cache tensor for every layer and writes each layer's slice with
``cache[i, rows, :, pos] = k``. Without help, inductor's code for it copies the layer's slice (an
out-of-place ``index_put``) and scatters it back into a new whole cache, every layer, every step (the cause
of compiled ``full`` running 75x slower than plain ``full`` on an H100). devgraph rewrites such writes into
a custom op that declares the mutation, which inductor re-inplaces; these tests read the code inductor
generates.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from zoo import CPU_TINY, build

from devgraph import GraphRunner
from devgraph.strategies.inplace import keep_writes_in_place, write_into

SHAPE = CPU_TINY.with_(layers=2, max_batch=4, max_len=32)


def dynamo_graph(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
    """The graph dynamo hands a backend for ``fn`` (static shapes)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args, **kwargs)
    return graphs[0]


def count(gm: torch.fx.GraphModule, target: Any) -> int:
    return sum(node.target is target for node in gm.graph.nodes)


def test_writes_into_a_slice_of_one_cache_become_the_op_and_others_stay():
    plain = build("plain", SHAPE)
    gm = dynamo_graph(plain.forward, **plain.make_step(4, 0))
    assert count(gm, operator.setitem) == 2 * SHAPE.layers
    assert keep_writes_in_place(gm) == 2 * SHAPE.layers
    assert count(gm, operator.setitem) == 0
    assert count(gm, torch.ops.devgraph.write_into.default) == 2 * SHAPE.layers

    # gpt-fast's layout: a cache tensor per layer, written whole with index_copy_: inductor re-inplaces it
    # itself (and fuses it), so it is left alone.
    gptfast = build("gptfast", SHAPE)
    gm = dynamo_graph(gptfast.forward, **gptfast.make_step(4, 0))
    assert keep_writes_in_place(gm) == 0


def test_the_rewritten_graph_computes_what_the_forward_does():
    def forward(cache: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        cache[1, rows, 2:4] = x[:, None]  # a view first (the int, a partial slice), then tensor indices
        cache[0].index_copy_(0, rows, x[:, None].expand(-1, 3))  # an in-place method on a view
        cache[:, rows] = cache[:, rows] * 2  # the whole input, tensor indices only: left as traced
        return cache.sum(0)

    cache, x, rows = torch.zeros(2, 4, 3), torch.tensor([1.0, 2.0]), torch.tensor([3, 0])
    rewritten: list[int] = []

    def rewriting(gm: torch.fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
        rewritten.append(keep_writes_in_place(gm))
        rewritten.append(count(gm, operator.setitem))
        return gm

    torch._dynamo.reset()
    expected_cache, got_cache = cache.clone(), cache.clone()
    expected = forward(expected_cache, x, rows)
    got = torch.compile(forward, backend=rewriting, fullgraph=True, dynamic=False)(got_cache, x, rows)
    assert rewritten == [2, 1]  # the two views rewritten, the whole-input write left as traced
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_cache, expected_cache)


def test_the_op_writes_like_setitem_and_like_the_method():
    target = torch.zeros(3, 4)
    write_into(target, "__setitem__", '[{"l": [1, {"s": [null, 2, null]}]}, {"t": 0}]', [torch.ones(2)], [])
    write_into(target, "index_fill_", '[0, {"t": 0}, 5.0]', [torch.tensor([2])], [])
    expected = torch.zeros(3, 4)
    expected[1, :2] = 1
    expected[2] = 5
    torch.testing.assert_close(target, expected)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_inductor_code_for_the_plain_decoder_copies_no_cache():
    """Fails without the rewrite: inductor's code then allocates a copy of each layer's cache slice (the
    out-of-place index_put) and copies the whole cache back into the buffer at the end of every step."""
    model = build("plain", SHAPE)
    module: Any = model.module
    flag = '{"decode": {"backend": "full", "compiler": "inductor"}}'
    runner = GraphRunner(
        model.forward, device="cpu", sizes=[4], config=flag, progress=False, **model.runner_kwargs()
    )
    with torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(runner.capture)
    source = "\n".join(code)
    slice_shape = f"({SHAPE.max_batch}, {SHAPE.kv_heads}, {SHAPE.max_len}, {SHAPE.head_dim})"
    assert f"empty_strided_cpu({slice_shape}" not in source  # no copy of a layer's cache
    assert "copy_" not in source.replace("write_into", "")  # no copy back into the cache
    assert source.count("torch.ops.devgraph.write_into.default(") == 2 * SHAPE.layers
    assert runner.inspect()["writes_kept_in_place"] == 2 * SHAPE.layers

    # The same step from the same cache: the graph's logits and cache writes equal eager's.
    step = model.make_step(3, 7)
    before = (module.k_cache.clone(), module.v_cache.clone())
    out = runner.run(copy=True, **step)
    after = (module.k_cache.clone(), module.v_cache.clone())
    module.k_cache.copy_(before[0])
    module.v_cache.copy_(before[1])
    with torch.no_grad():
        expected = model.forward(**step)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after[0][:, :3], module.k_cache[:, :3], rtol=1e-4, atol=1e-4)
    runner.close()


@pytest.mark.cuda
@pytest.mark.slow
def test_on_cuda_the_plain_decoder_compiles_without_cache_copies():
    model = build("plain", SHAPE, "cuda", torch.bfloat16)
    flag = '{"decode": {"backend": "full", "compiler": "inductor"}}'
    runner = GraphRunner(
        model.forward, device="cuda", sizes=[1, 4], config=flag, progress=False, **model.runner_kwargs()
    )
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            _, code = run_and_get_code(runner.capture)
        source = "\n".join(code)
        slice_shape = f"({SHAPE.max_batch}, {SHAPE.kv_heads}, {SHAPE.max_len}, {SHAPE.head_dim})"
        assert f"empty_strided_cuda({slice_shape}" not in source
        assert source.count("torch.ops.devgraph.write_into.default(") >= 2 * SHAPE.layers
        info = runner.inspect()
        assert info["writes_kept_in_place"] >= 2 * SHAPE.layers
        assert set(info["compiled_or_plain"]["keys"]) == {"tokens=1", "tokens=4"}  # timed by CUDA events
        for n, seed in ((3, 1), (4, 2)):
            result = runner.verify(**model.make_step(n, seed))
            assert result.replayed and result.max_abs_diff == 0 and result.ok, result
    finally:
        runner.close()
