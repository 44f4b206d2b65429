"""State a forward advances without declaring it, found on the first key's warm-ups
(``devgraph.runner.capture.undeclared``): warned about once, naming shape, dtype, where it lives and the fix;
adopted with ``state="auto"``, so ``capture()`` and ``verify()`` leave it as they found it. The pattern is
Hugging Face 5.x's static cache: the write position is a 0-d tensor the forward advances in place."""

from __future__ import annotations

import logging

import pytest
import torch

from devgraph import GraphRunner, StaticInput
from devgraph.runner.state import StateHooks

INPUTS = {"x": StaticInput(torch.float32, (3,), fill=0.0)}
SIZES = [1, 2, 4]


class PositionCache:
    """Keys written at a position kept on the device, advanced by every forward (HF 5.x StaticLayer)."""

    def __init__(self) -> None:
        self.keys = torch.zeros(4, 32, 3)
        self.cumulative_length = torch.zeros((), dtype=torch.int64)


class Model:
    def __init__(self) -> None:
        self.cache = PositionCache()
        self.weight = torch.randn(3, 3)
        self.scratch = torch.zeros(4, 3)  # written every step from the inputs only: not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        position = self.cache.cumulative_length
        self.scratch[:rows].copy_(x @ self.weight)
        self.cache.keys[:rows].index_copy_(1, position.view(1), self.scratch[:rows, None])
        self.cache.cumulative_length.add_(1)
        return self.cache.keys[:rows].sum(1) + position


def runner(model: Model, state=None, mode: str = "full", **kwargs) -> GraphRunner:
    return GraphRunner(
        model.forward,
        phase="decode",
        inputs=INPUTS,
        device="cpu",
        sizes=SIZES,
        mode=mode,
        state=state,
        **kwargs,
    )


@pytest.mark.parametrize("mode", ["full", "breakable", "tc_piecewise"])
def test_undeclared_write_position_is_found_and_named(mode, caplog):
    model = Model()
    with caplog.at_level(logging.WARNING, logger="devgraph.runner.capture.undeclared"):
        report = runner(model, mode=mode).capture()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1  # once, not per key
    message = warnings[0]
    assert "a 0-d torch.int64 tensor on cpu (self.cache.cumulative_length)" in message
    assert "state='auto'" in message and "state=[tensor, ...]" in message
    assert "scratch" not in message  # rewritten from the inputs each step: the same after both runs
    assert report.notes == [message.removeprefix("devgraph: ")]


def test_state_auto_adopts_it_and_leaves_it_as_found():
    model = Model()
    model.cache.cumulative_length.fill_(5)
    live = runner(model, state="auto")
    live.capture()
    assert model.cache.cumulative_length.item() == 5  # before: 5 + the warm-ups of every key
    assert "self.cache.cumulative_length" in live.inspect()["state"]["tensors"]
    result = live.verify(x=torch.randn(3, 3))
    assert result.replayed and result.ok and model.cache.cumulative_length.item() == 5
    live.run(x=torch.randn(3, 3))  # a real step advances it once
    assert model.cache.cumulative_length.item() == 6


def test_declared_state_is_not_reported(caplog):
    model = Model()
    with caplog.at_level(logging.WARNING, logger="devgraph.runner.capture.undeclared"):
        report = runner(model, state=[model.cache.cumulative_length]).capture()
    assert not caplog.records and not report.notes
    assert model.cache.cumulative_length.item() == 0


def test_hooks_hide_state_from_the_probe_so_it_stays_quiet(caplog):
    model = Model()
    position = model.cache.cumulative_length
    hooks = StateHooks(save=position.clone, restore=position.copy_)
    with caplog.at_level(logging.WARNING, logger="devgraph.runner.capture.undeclared"):
        runner(model, state=hooks).capture()
    assert not caplog.records and position.item() == 0


def test_one_warm_up_gets_one_more_run_whose_writes_are_undone():
    model = Model()
    runner(model, warmup_iters=1).capture()
    # one warm-up per key moves it once per key, as asked: the probe's extra run was undone
    assert model.cache.cumulative_length.item() == len(SIZES)


def test_no_warm_ups_no_probe(caplog):
    model = Model()
    with caplog.at_level(logging.WARNING, logger="devgraph.runner.capture.undeclared"):
        runner(model, warmup_iters=0).capture()
    assert not caplog.records


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_hugging_face_static_cache_write_position(caplog, device):
    tf = pytest.importorskip("transformers")
    from devgraph.integrations.hf.cache import SharedStaticCache
    from devgraph.integrations.hf.features import find_features

    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(device).eval()
    cache = SharedStaticCache(model, 4, 16)
    mask = torch.ones(4, 16, dtype=torch.bool, device=device)
    argument = find_features(model).cache_argument  # the forward's name for the cache in this release

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.shape[0]
        view = cache.view(rows)
        return model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask[:rows], **{argument: view}
        ).logits

    inputs = {"input_ids": StaticInput(torch.long, (1,)), "position_ids": StaticInput(torch.long, (1,))}
    with caplog.at_level(logging.WARNING, logger="devgraph.runner.capture.undeclared"):
        found = GraphRunner(forward, phase="decode", inputs=inputs, device=device, sizes=[1, 2], mode="full")
        found.capture()
    assert f"0-d torch.int64 tensor on {device}" in caplog.text
    assert "(cache.full.layers[0].cumulative_length)" in caplog.text
    auto = GraphRunner(
        forward, phase="decode", inputs=inputs, device=device, sizes=[1, 2], mode="full", state="auto"
    )
    cache.rewind()
    auto.capture()
    ids = torch.tensor([[3], [5]], device=device)
    assert auto.verify(input_ids=ids, position_ids=torch.zeros(2, 1, dtype=torch.long, device=device)).ok
    assert cache.position() == 0
