"""Greedy tokens from two Triton kernels (devgraph.reference.kernels.triton_argmax) and their use in sampling
(devgraph.reference.fused.greedy_tokens, devgraph.serve.engine.sampler.sample_on_device).

CPU: under ``TRITON_INTERPRET=1`` in a child process, ``torch.argmax`` bit for bit on the three dtypes at
vocabularies that are and are not multiples of a chunk, with ties inside a chunk and across chunks, rows of
``-inf``, ``+inf`` and NaN; the sampler given the kernels' greedy tokens against its own argmax, with greedy
and random rows mixed, and its slot write; the refusals. GPU (``cuda`` marker): a served vocabulary at
1-256 rows, plain and inside a CUDA graph.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (the kernels are Triton)")

_SCRIPT = textwrap.dedent(
    """
    import torch
    from devgraph.reference.fused import greedy_tokens
    from devgraph.reference.kernels.triton_argmax import BLOCK, argmax_rows
    from devgraph.serve.engine.sampler import Sampler, sample_on_device
    from devgraph.serve.engine.request import Request
    from devgraph.serve.engine import SamplingParams

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for rows, vocab in ((1, 3 * BLOCK + 17), (6, 2 * BLOCK), (6, BLOCK + 1), (2, 1), (3, 7)):
            x = torch.randn(rows, vocab, generator=gen).to(dtype)
            if vocab > BLOCK:  # equal maxima in two chunks, and twice in one chunk: the lowest index
                x[0, vocab - 3] = x[0, 5] = x[0, 9] = 60
            if rows > 1:
                x[1] = float("-inf")  # no number larger than another: index 0
            if rows > 2:
                x[2, -1] = float("nan")  # a NaN beats everything, +inf included; the first NaN wins
                x[2, 0] = float("inf")
                if vocab > 2:
                    x[2, 1] = float("nan")
            if rows > 3:
                x[3, -1] = float("inf")
                x[3, 0] = -0.0
            if rows > 4:
                x[4] = 0.0
                x[4, :: max(1, vocab // 5)] = -0.0  # -0.0 and 0.0 are equal: index 0
            if rows > 5:
                x[5, -1] = float("nan")  # the only NaN in the row's last chunk
            got = argmax_rows(x)
            assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), (dtype, rows, vocab, got)
            checked += 1
    # Strided rows (a view of the leading rows' columns).
    wide = torch.randn(4, 3 * BLOCK, generator=gen, dtype=torch.float16)
    view = wide[:, : 2 * BLOCK + 5]
    assert torch.equal(argmax_rows(view), view.argmax(-1))
    # greedy_tokens: the kernels when fused, torch when not, the same tokens either way.
    for fused in (True, False):
        assert torch.equal(greedy_tokens(view, fused), view.argmax(-1))
    # The sampler: greedy and seeded random rows mixed, log probabilities asked; its greedy tokens from the
    # kernels (as a decode graph gives them) or its own argmax: the same tokens, slots and log probabilities.
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.8, top_k=50, seed=3),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9, seed=5)]
    logits = torch.randn(4, 3 * BLOCK + 1, generator=gen)
    results = {}
    for greedy in (argmax_rows(logits), None):
        requests = [Request(str(i), [1, 2, 3], p, 0.0) for i, p in enumerate(params)]
        plan = Sampler().plan(requests)
        slots = torch.zeros(16, dtype=torch.int64)
        tokens, logprobs = sample_on_device(logits, plan, plan.arrays, greedy=greedy,
                                            write_to=(slots, torch.tensor([3, 7, 1, 12])))
        results[greedy is None] = (tokens, slots, [t.clone() for t in logprobs.tensors()])
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert all(torch.equal(a, b) for a, b in zip(results[True][2], results[False][2]))
    assert results[True][1][[3, 7, 1, 12]].tolist() == results[True][0].tolist()
    # The op a decode graph's greedy tokens go through, and a tiny model's decode step with them.
    from devgraph.reference import fused
    torch.library.opcheck(fused._argmax_op, (torch.randn(3, 2 * BLOCK + 3, generator=gen),))
    from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch
    config = ReferenceConfig.preset("tiny", max_requests=4, dtype=torch.float16, kernels="triton")
    model = ReferenceModel(config)
    assert model.fused
    logits, tokens = model.decode_step_with_greedy(**make_decode_batch(model, 3, seed=3))
    assert torch.equal(tokens, logits.argmax(-1))
    # The engine's census counts the two launches (no aten ops) where they ran: in the forward of a decode
    # step run eagerly.
    from devgraph.serve.engine import Engine, EngineConfig
    from devgraph.serve.engine.step_ops import StepOps
    settings = EngineConfig(max_running_requests=2, token_budget=16)
    engine = Engine(model, settings, device_graph_mode="disabled", progress=False)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=8))
    while not engine.step_counts["decode"]:
        engine.step()
    with StepOps(engine) as census:
        engine.step()
    assert census.steps[0].ops["runner"]["triton_argmax"] == 2, census.steps[0].ops
    engine.close()
    print("argmax ok", checked)
    """
)


def test_greedy_tokens_equal_torch_argmax_under_the_interpreter(run_under_triton_interpreter):
    assert "argmax ok 15" in run_under_triton_interpreter(_SCRIPT)  # 3 dtypes x 5 shapes


def test_what_the_kernels_cannot_take_is_refused_with_the_reason():
    from devgraph.reference.kernels.triton_argmax import argmax_rows

    for bad, reason in (
        (torch.zeros(3, dtype=torch.int64).view(1, 3), "got torch.int64"),
        (torch.zeros(1, 3, dtype=torch.float64), "got torch.float64"),  # compared in float32: not exact
        (torch.zeros(2, 3, 4), "float32 logits [R, V]"),
        (torch.zeros(4, 3).t(), "unit-stride"),
    ):
        with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
            argmax_rows(bad)
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(torch.zeros(1, 3), block=100)


def test_unfused_greedy_tokens_are_torch_argmax_and_the_sampler_writes_each_into_its_slot():
    from devgraph.reference.fused import greedy_tokens
    from devgraph.serve.engine import SamplingParams
    from devgraph.serve.engine.request import Request
    from devgraph.serve.engine.sampler import Sampler, sample_on_device

    logits = torch.randn(5, 33)
    logits[1, 3] = logits[1, 7] = 99
    tokens = greedy_tokens(logits, False)
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[1] == 3
    plan = Sampler().plan([Request(str(i), [1], SamplingParams(temperature=0), 0.0) for i in range(5)])
    slots = torch.zeros(6, dtype=torch.int64)
    sampled, _ = sample_on_device(logits, plan, plan.arrays, write_to=(slots, torch.tensor([5, 0, 2, 1, 3])))
    assert torch.equal(sampled, tokens)
    assert slots.tolist() == [tokens[1], tokens[3], tokens[2], tokens[4], 0, tokens[0]]
    # fused but on the CPU without the interpreter: torch's argmax, never a Triton launch on a CPU tensor
    assert torch.equal(greedy_tokens(logits, True), logits.argmax(-1))


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_on_a_gpu_greedy_tokens_equal_torch_argmax_plain_and_in_a_cuda_graph():
    from devgraph.reference.kernels.triton_argmax import argmax_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 32, 256):
            x = torch.randn(rows, 151936, device="cuda", dtype=dtype, generator=gen)
            x[0, 100] = x[0, 150000] = 80  # equal maxima far apart
            if rows > 2:
                x[1] = float("-inf")
                x[2, 7000] = float("nan")
            assert torch.equal(argmax_rows(x), x.argmax(-1)), (dtype, rows)
    x = torch.randn(32, 151936, device="cuda", dtype=torch.bfloat16, generator=gen)
    argmax_rows(x)  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen.manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, x.argmax(-1))


class _OnlyToken:
    """A grammar state whose masker allows one token, writing in place (as the protocol allows)."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.masker = self

    def mask(self, logits, rows, states):
        for row, state in zip(rows, states, strict=True):
            keep = logits[row, state.token].clone()
            logits[row] = float("-inf")
            logits[row, state.token] = keep
        return logits


def test_the_graphs_greedy_tokens_are_used_unless_a_grammar_masks_the_rows():
    from devgraph.serve.engine import SamplingParams
    from devgraph.serve.engine.request import Request
    from devgraph.serve.engine.sampler import Sampler, sample_on_device

    logits = torch.randn(3, 40)
    requests = [Request(str(i), [1, 2], SamplingParams(temperature=0), 0.0) for i in range(3)]
    plan = Sampler().plan(requests)
    marked = torch.tensor([7, 8, 9])  # not the argmax: shows which tokens were taken
    slots = torch.zeros(5, dtype=torch.int64)
    tokens, _ = sample_on_device(
        logits, plan, plan.arrays, greedy=marked, write_to=(slots, torch.tensor([4, 0, 2]))
    )
    assert tokens is marked and slots.tolist() == [8, 0, 9, 0, 7]
    # a grammar on one row: every row's argmax of the masked logits, never the graph's tokens
    requests[1].grammar = _OnlyToken(31)
    plan = Sampler().plan(requests)
    expected = logits.argmax(-1)
    expected[1] = 31
    tokens, _ = sample_on_device(logits.clone(), plan, plan.arrays, greedy=marked)
    assert tokens.tolist() == expected.tolist()


def test_a_decode_graph_gives_the_greedy_tokens_of_its_logits_at_every_size():
    from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner, make_decode_batch

    model = ReferenceModel(ReferenceConfig.preset("tiny", max_requests=8), seed=0)
    runner = decode_runner(model, greedy=True, sizes=[1, 4, 8], progress=False)
    runner.capture()
    for n in (1, 3, 4, 6):
        model.randomize_cache(seed=n)
        batch = make_decode_batch(model, n, seed=n)
        logits, tokens = runner.run(**batch, copy=True)
        assert logits.shape[0] == tokens.shape[0] == n and tokens.dtype == torch.int64
        assert torch.equal(tokens, logits.argmax(-1))
        # the padded graph's logits: the eager step's up to float32 rounding of rows summed otherwise
        torch.testing.assert_close(logits, model.decode_step(**batch), rtol=1e-4, atol=1e-4)
    assert runner.stats()["replays"] == 4
    runner.close()


@pytest.mark.cuda
@pytest.mark.timeout(180)
def test_on_a_gpu_a_decode_graph_samples_greedy_rows_inside_the_replay():
    from devgraph.reference import ReferenceConfig, ReferenceModel, decode_runner, make_decode_batch

    config = ReferenceConfig.preset("tiny", max_requests=8, dtype=torch.bfloat16, vocab_size=5000)
    model = ReferenceModel(config, device="cuda", seed=0)
    assert model.fused  # the Triton kernels on a GPU
    runner = decode_runner(model, greedy=True, sizes=[1, 4, 8], progress=False)
    runner.capture()
    for n in (1, 3, 8):
        model.randomize_cache(seed=n)
        logits, tokens = runner.run(**make_decode_batch(model, n, seed=n), copy=True)
        assert torch.equal(tokens, logits.argmax(-1)), n
    assert runner.stats()["replays"] == 3
    runner.close()
