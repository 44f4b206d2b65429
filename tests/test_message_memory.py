"""Reused step-message memory: host buffers lent and taken back, one device buffer per size class, each
layout's views made once, narrow inputs padded per step, and an engine whose every step goes through it
producing the tokens of one that allocates afresh.

On the CPU ``copy=True`` makes the memory copy each message into its own "device" buffer as it does on a
GPU (without events: the copy is done when it returns), so everything but the pinned memory and the
events runs here; ``test_cuda.py`` runs the rest.
"""

from __future__ import annotations

import pytest
import torch

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.reference.inputs import StepContext
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams
from devgraph.serve.engine.message_memory import MAX_HOST_BUFFERS, MIN_CLASS_BYTES, MessageMemory
from devgraph.serve.engine.wire import TRIM_MIN_BYTES, encode_step

CPU = torch.device("cpu")


def _decode(requests: int, seed: int) -> tuple[dict[str, torch.Tensor], StepContext]:
    generator = torch.Generator().manual_seed(seed)
    inputs = {
        "input_ids": torch.randint(0, 1000, (requests,), generator=generator),
        "positions": torch.randint(0, 100, (requests,), generator=generator),
        "scale": torch.rand(requests, generator=generator, dtype=torch.float32),
    }
    return inputs, StepContext(seq_lens=[int(x) + 1 for x in inputs["positions"]])


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_alternating_layouts_give_each_steps_own_values_from_reused_buffers() -> None:
    memory = MessageMemory(CPU, copy=True)
    for step in range(40):
        requests = (1, 7, 64)[step % 3]
        inputs, context = _decode(requests, seed=step)
        message = encode_step("decode", inputs, context, step=step, allocate=memory.host_buffer)
        _check(memory.inputs(message), inputs)
        assert message.context() == context
    # Three layouts, at most two size classes: one host buffer each (every copy is done at once here).
    assert memory.allocated <= 2
    assert memory.waits == 0


def test_the_views_of_a_layout_are_made_once_and_read_the_latest_copy() -> None:
    memory = MessageMemory(CPU, copy=True)
    first, context = _decode(4, seed=1)
    one = memory.inputs(encode_step("decode", first, context, allocate=memory.host_buffer))
    second, context = _decode(4, seed=2)
    two = memory.inputs(encode_step("decode", second, context, allocate=memory.host_buffer))
    assert one["input_ids"].data_ptr() == two["input_ids"].data_ptr()  # one device buffer, reused
    _check(two, second)  # (and ``one`` now reads step two's values: valid until the next step's copy)


def test_an_input_sent_narrower_is_padded_with_zeros_to_its_width() -> None:
    memory = MessageMemory(CPU, copy=True)
    width = TRIM_MIN_BYTES // 8  # a block table wide enough that leaving columns off pays
    tables = torch.zeros(4, width, dtype=torch.int64)
    tables[:, :3] = torch.arange(12).reshape(4, 3)
    for _ in range(2):
        message = encode_step(
            "decode", {"block_tables": tables}, None, columns={"block_tables": 3}, allocate=memory.host_buffer
        )
        assert message.buffer.numel() < tables.numel() * 8  # columns left off the wire
        _check(memory.inputs(message), {"block_tables": tables})


def test_a_lent_buffer_is_never_lent_again_before_its_copy() -> None:
    memory = MessageMemory(CPU, copy=True)
    held = [memory.host_buffer(100) for _ in range(MAX_HOST_BUFFERS)]
    assert len({int(b.data_ptr()) for b in held}) == MAX_HOST_BUFFERS
    extra = memory.host_buffer(100)  # every pooled buffer is lent: a buffer of its own, not pooled
    assert int(extra.data_ptr()) not in {int(b.data_ptr()) for b in held}
    inputs, context = _decode(2, seed=3)
    unpooled = encode_step("decode", inputs, context)
    _check(memory.inputs(unpooled), inputs)  # a buffer it did not lend crosses as the message's own


def test_size_classes_are_powers_of_two_from_the_smallest() -> None:
    memory = MessageMemory(CPU, copy=True)
    assert memory.host_buffer(1).numel() == 1
    small = memory.host_buffer(10)
    big = memory.host_buffer(MIN_CLASS_BYTES + 1)
    assert small.untyped_storage().nbytes() == MIN_CLASS_BYTES
    assert big.untyped_storage().nbytes() == 2 * MIN_CLASS_BYTES


def test_without_copies_every_buffer_is_new_and_the_inputs_are_its_views() -> None:
    memory = MessageMemory(CPU)
    inputs, context = _decode(3, seed=4)
    message = encode_step("decode", inputs, context, allocate=memory.host_buffer)
    got = memory.inputs(message)
    _check(got, inputs)
    start = message.buffer.data_ptr()
    assert start <= got["input_ids"].data_ptr() < start + message.buffer.numel()


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(ReferenceConfig.preset("tiny", max_requests=8), seed=0)


def _greedy(model: ReferenceModel, memory: MessageMemory | None) -> dict[str, list[int]]:
    """Greedy tokens of requests that start and finish at different steps (decode batches of changing
    sizes, prefill chunks, a KV block crossed), with the engine's default overlapped scheduler."""
    config = EngineConfig(max_running_requests=8, token_budget=32)
    engine = Engine(model, config, device_graph_mode="auto", progress=False)
    if memory is not None:
        engine.message_memory = memory
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [(7 * j) % 500 for j in range(40)]]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=12 + 7 * i), request_id=f"r{i}")
        tokens[f"r{i}"] = []
    while engine.has_work:
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    engine.close()
    return tokens


def test_an_engine_whose_steps_reuse_one_device_buffer_samples_the_same_tokens(model: ReferenceModel) -> None:
    memory = MessageMemory(CPU, copy=True)
    reused = _greedy(model, memory)
    assert reused == _greedy(model, None)
    assert all(len(t) == 12 + 7 * i for i, t in enumerate(reused.values()))
    assert 0 < memory.allocated <= 4  # a size class or two, each buffer free again at once on the CPU


@pytest.mark.cuda
def test_on_a_busy_gpu_no_host_buffer_is_rewritten_before_its_copy_ran() -> None:
    device = torch.device("cuda")
    memory = MessageMemory(device)
    got, want = [], []
    for step in range(3 * MAX_HOST_BUFFERS):
        torch.cuda._sleep(5_000_000)  # the stream is busy: this step's copy queues behind the sleep
        inputs, context = _decode(7, seed=step)
        message = encode_step("decode", inputs, context, step=step, allocate=memory.host_buffer)
        got.append({name: view.clone() for name, view in memory.inputs(message).items()})  # stream order
        want.append(inputs)
    torch.cuda.synchronize()
    for step_got, step_want in zip(got, want, strict=True):
        _check({name: tensor.cpu() for name, tensor in step_got.items()}, step_want)
    assert memory.allocated == MAX_HOST_BUFFERS  # the ring grew to its cap, then the host waited
    assert memory.waits > 0


def test_a_message_that_never_crossed_gives_its_buffer_back() -> None:
    memory = MessageMemory(CPU, copy=True)
    for step in range(3 * MAX_HOST_BUFFERS):  # every step fails between encoding and issuing
        inputs, context = _decode(5, seed=step)
        message = encode_step("decode", inputs, context, step=step, allocate=memory.host_buffer)
        memory.release(message)
    assert memory.allocated == 1  # the one buffer, lent again each time


def test_a_copy_that_fails_leaves_its_buffer_free(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = MessageMemory(CPU, copy=True)
    inputs, context = _decode(5, seed=0)
    message = encode_step("decode", inputs, context, allocate=memory.host_buffer)
    original = torch.Tensor.copy_

    def failing(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(torch.Tensor, "copy_", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        memory.inputs(message)
    monkeypatch.setattr(torch.Tensor, "copy_", original)
    again = encode_step("decode", inputs, context, allocate=memory.host_buffer)
    assert again.buffer.data_ptr() == message.buffer.data_ptr() and memory.allocated == 1
    _check(memory.inputs(again), inputs)
