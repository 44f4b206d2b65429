"""The sanitizer's corpus: one small forward or engine fragment per graph bug class the peers shipped, each
reproduced the way the peer hit it (source cited: repository and number), and devgraph stopping it at
capture or at the first replay with an error that names the class and the fix, or showing by construction
that it cannot happen. docs/sanitizer.md has the table; the two rank classes run as ranks in
tests/test_dp.py (gloo here, NCCL under ``multi_gpu``).

Every test runs on the CPU simulator (CI) and, ``cuda``-marked, on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import devgraph
from devgraph import CaptureError, GraphKey, GraphRunner, StaticInput, graph_break
from devgraph.errors import ReplayError
from devgraph.platforms.sim.device_memory import SIM_MEMORY
from devgraph.ranks import CaptureSync
from devgraph.reference import (
    ReferenceConfig,
    ReferenceModel,
    decode_runner,
    make_decode_batch,
    make_verify_batch,
    verify_runner,
)
from devgraph.runner.guard.host_values import HostValues

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
WIDTH = 8


def _runner(forward: Any, device: str, **kwargs: Any) -> GraphRunner:
    kwargs.setdefault("sizes", [2, 4])
    kwargs.setdefault("mode", "full")
    return GraphRunner(
        forward,
        phase="decode",
        inputs={"x": StaticInput(torch.float32, (WIDTH,))},
        device=device,
        progress=False,
        **kwargs,
    )


def _stopped(capture: Any, replay: Any) -> tuple[str, str]:
    """Where devgraph stopped a class (``capture`` or ``replay``) and its message; fails if neither did."""
    try:
        capture()
    except CaptureError as exc:
        return "capture", str(exc)
    try:
        replay()
    except ReplayError as exc:
        return "replay", str(exc)
    raise AssertionError("neither the capture nor the first replay was stopped")


def _tiny(device: str) -> ReferenceModel:
    model = ReferenceModel(ReferenceConfig.preset("tiny", max_seq_len=64), device=device, seed=0)
    model.randomize_cache(seed=0)
    return model


# -- 1. A host scalar baked into a kernel's launch arguments (huggingface/transformers#45323) -------------
@dataclasses.dataclass
class VarlenMeta:
    """Continuous batching's per-step metadata: the longest key length of the batch, a Python int that
    FlashAttention's varlen kernels take as a launch argument (transformers keyed its graphs without it)."""

    max_seqlen_k: int


def _varlen(q: torch.Tensor, max_seqlen_k: int) -> torch.Tensor:
    return torch.softmax(q * max_seqlen_k**-0.5, dim=-1)


def varlen_forward(x: torch.Tensor) -> torch.Tensor:
    return _varlen(x, devgraph.get_forward_context().max_seqlen_k)


@graph_break("devgraph_test::varlen_live")
def varlen_live(x: torch.Tensor) -> torch.Tensor:
    return _varlen(x, devgraph.get_forward_context().max_seqlen_k)


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_scalar_baked_at_capture_stops_the_first_replay_that_differs(device):
    runner = _runner(varlen_forward, device, capture_context=lambda key: VarlenMeta(1024))
    runner.capture()
    x = torch.randn(3, WIDTH, device=device)
    same = runner.run(x=x, context=VarlenMeta(1024))
    torch.testing.assert_close(same, _varlen(x, 1024))
    # Same padded size, another max_seqlen_k: the graph would replay 1024 (GSM8K 0.45 -> 0.23 there).
    with pytest.raises(ReplayError, match=r"context\.max_seqlen_k was 1024 at capture and is 4096 now"):
        runner.run(x=x, context=VarlenMeta(4096))
    # The fix the message names: read it inside a break op, which runs eagerly with the live context.
    live = _runner(
        lambda x: varlen_live(x), device, mode="breakable", capture_context=lambda k: VarlenMeta(1024)
    )
    live.capture()
    torch.testing.assert_close(live.run(x=x, context=VarlenMeta(4096)), _varlen(x, 4096))


def test_a_compiled_forward_that_reads_the_context_captures_with_the_sanitizer_on():
    # Dynamo traces the forward during the capture; the recording view (a proxy) made that trace fail and
    # the capture with it, with the checks on (the default) and never with them off.
    runner = _runner(varlen_forward, "cpu", compiler="eager", capture_context=lambda key: VarlenMeta(1024))
    runner.capture()
    x = torch.randn(3, WIDTH)
    torch.testing.assert_close(runner.run(x=x, context=VarlenMeta(1024)), _varlen(x, 1024))
    assert runner.stats()["replays"] == 1


@dataclasses.dataclass
class StaticMeta(VarlenMeta):
    """The same metadata with ``max_seqlen_k`` declared static: the graph keeps the capture's on purpose."""

    __devgraph_static__ = ("max_seqlen_k",)


def test_a_value_declared_static_is_not_checked():
    runner = _runner(varlen_forward, "cpu", capture_context=lambda key: StaticMeta(1024))
    runner.capture()
    x = torch.randn(3, WIDTH)
    torch.testing.assert_close(runner.run(x=x, context=VarlenMeta(4096)), _varlen(x, 1024))
    assert runner.inspect()["address_guard"]["host_values"]["values"] == []


def test_no_context_at_replay_and_the_switch_leave_the_graph_alone(monkeypatch):
    runner = _runner(varlen_forward, "cpu", capture_context=lambda key: VarlenMeta(1024))
    runner.capture()
    x = torch.randn(3, WIDTH)
    torch.testing.assert_close(runner.run(x=x), _varlen(x, 1024))  # nothing to compare with
    monkeypatch.setenv("DEVGRAPH_SANITIZE", "0")
    off = _runner(varlen_forward, "cpu", capture_context=lambda key: VarlenMeta(1024))
    off.capture()
    torch.testing.assert_close(off.run(x=x, context=VarlenMeta(4096)), _varlen(x, 1024))  # stale, as asked
    assert off.inspect()["address_guard"]["host_values"]["enabled"] is False


# -- 2. A host-side attention plan frozen into the graph (sgl-project/sglang#39825) -----------------------
@dataclasses.dataclass
class VerifyPlan:
    """DFlash's TARGET_VERIFY metadata: host-fed fast-plan inputs recomputed every step (the indptr of
    each request's accepted tokens), which the metadata graph captured as they were at capture."""

    qo_indptr: list[int]


def planned_forward(x: torch.Tensor) -> torch.Tensor:
    plan = devgraph.get_forward_context()
    # The plan step turns the host values into device indices inside the captured region.
    ends = torch.tensor(plan.qo_indptr[1:], device=x.device) - 1
    return x.index_select(0, ends.clamp(0, x.shape[0] - 1))


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_attention_plan_is_never_replayed_frozen(device):
    runner = _runner(
        planned_forward, device, capture_context=lambda key: VerifyPlan(list(range(key.tokens + 1)))
    )
    x = torch.randn(4, WIDTH, device=device)
    where, message = _stopped(runner.capture, lambda: runner.run(x=x, context=VerifyPlan([0, 2, 3, 3, 4])))
    # The simulator stops the first replay whose plan differs; a GPU may refuse the host copy at capture.
    assert (
        ("context.qo_indptr was (0, 1, 2, 3, 4) at capture" in message)
        if where == "replay"
        else ("host" in message)
    ), message


# -- 3. Break-op inputs held weakly and reused by a later bucket (sgl-project/sglang#37448, #37606) -------
@graph_break("devgraph_test::attend")
def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.T, dim=-1) @ k


@pytest.mark.parametrize("device", DEVICES)
def test_break_op_inputs_of_every_bucket_stay_valid_across_later_captures(device):
    # Buckets captured largest first into one pool; a later bucket reuses the memory of an earlier one's
    # break inputs. Replay alternates buckets and keeps a copied output across the other's replays.
    weight = torch.randn(WIDTH, WIDTH, device=device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        q = torch.tanh(x @ weight)
        return attend(q, q * 0.5) + 1.0

    runner = _runner(forward, device, mode="breakable", sizes=[2, 4, 8])
    runner.capture()
    kept = []
    for i, n in enumerate([8, 2, 8, 4, 2, 8]):
        x = torch.randn(n, WIDTH, device=device, generator=None)
        kept.append((x, runner.run(x=x, copy=True)))
        for x_old, out_old in kept:
            torch.testing.assert_close(out_old, forward(x_old), msg=f"step {i}")


# -- 4. Ranks that capture different graphs (vllm-project/vllm#39788, #39791) ----------------------------
def test_the_capture_handshake_covers_keys_graph_set_and_buffers(registry):
    # Two ranks run this handshake (tests/test_dp.py, tests/test_tp.py); here, what its digest covers.
    platform = registry.platform("cpu")
    keys = [GraphKey(4), GraphKey(2)]
    full = _runner(lambda x: x, "cpu").backend
    breakable = _runner(lambda x: x, "cpu", mode="breakable").backend
    buffers = {"x": torch.zeros(4, WIDTH)}

    def digest(keys: list[GraphKey], backend: Any, buffers: dict[str, torch.Tensor]) -> str:
        return CaptureSync(platform, None, "decode", keys, backend, buffers=buffers)._digest

    base = digest(keys, full, buffers)
    assert digest(keys, full, {"x": torch.zeros(4, WIDTH)}) == base
    assert digest(keys[:1], full, buffers) != base  # a rank with other sizes
    assert digest(keys, breakable, buffers) != base  # a rank with another graph set
    assert digest(keys, full, {"x": torch.zeros(4, WIDTH, dtype=torch.float16)}) != base  # other buffers


# -- 6. A draft model's graph replayed after sleep and wake (vllm-project/vllm#55013) ----------------------
@pytest.mark.parametrize("device", DEVICES)
def test_a_draft_graph_after_sleep_and_wake_is_stopped_before_it_reads_freed_memory(device):
    target, draft = _tiny(device), _tiny(device)
    draft_runner = decode_runner(draft, mode="full", sizes=[1, 2, 4], progress=False)
    draft_runner.capture()
    batch = make_decode_batch(draft, 3, seq_lens=5)
    draft_runner.run(**batch)
    # Sleep (level 2): the engine gives every weight's memory back and keeps the tensor objects (as a
    # sleep-mode allocator unmapping it does); the target's runner is released first, the draft's is not.
    sizes = [param.untyped_storage().nbytes() for param in draft.parameters()]
    before = [param.untyped_storage().data_ptr() for param in draft.parameters()]
    for param in draft.parameters():
        param.untyped_storage().resize_(0)
    # What was given back goes to others meanwhile (without this, a caching allocator may hand the same
    # blocks straight back to the resize below, and the graphs would then read the reloaded weights).
    others = [torch.empty(nbytes, dtype=torch.uint8, device=device) for nbytes in sizes]
    # Wake: memory mapped again (elsewhere) and the weights reloaded into it; the draft's graphs stay.
    for param, reloaded, nbytes in zip(draft.parameters(), target.parameters(), sizes, strict=True):
        param.untyped_storage().resize_(nbytes)
        with torch.no_grad():
            param.copy_(reloaded)
    after = [param.untyped_storage().data_ptr() for param in draft.parameters()]
    assert all(new != old for new, old in zip(after, before, strict=True))  # the premise: every one moved
    del others
    with pytest.raises(ReplayError, match=r"(moved to new memory|was freed).*runner\.refresh\(\)"):
        draft_runner.run(**batch)
    draft_runner.refresh()  # what the message asks: capture again on the new weights
    assert draft_runner.verify(**batch).ok


# -- 7. An out-of-memory during capture reported as an invalidated capture (pytorch/pytorch#159594) ------
def _large(x: torch.Tensor) -> torch.Tensor:
    return (x @ torch.ones(WIDTH, 1 << 16, device=x.device)).relu() @ torch.ones(
        1 << 16, WIDTH, device=x.device
    )


def test_an_out_of_memory_during_capture_is_named_as_one_on_the_simulator():
    runner = _runner(_large, "cpu")
    SIM_MEMORY.capture_limit = 1 << 20  # the device has 1 MiB left for graphs
    try:
        with pytest.raises(CaptureError, match="ran out of memory during capture.*lower max_size") as raised:
            runner.capture()
    finally:
        SIM_MEMORY.capture_limit = None
    assert raised.value.cause == "out_of_memory"  # type: ignore[attr-defined]
    assert "cudaErrorStreamCaptureInvalidated" in str(raised.value)  # what the device said, kept


@pytest.mark.cuda
def test_an_out_of_memory_during_capture_is_named_as_one_on_a_gpu():
    # One forward's activations (4096 x 65536 floats, 1 GiB) fit beside what is reserved, two do not: the
    # warm-ups run in the allocator's cache, the capture needs a second GiB in the graph's own pool.
    runner = _runner(_large, "cuda", sizes=[4096])
    activations = 4096 * (1 << 16) * 4
    total = torch.cuda.mem_get_info()[1]
    budget = torch.cuda.memory_reserved() + int(1.5 * activations)
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    try:
        with pytest.raises(CaptureError, match="out of memory") as raised:
            runner.capture()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        runner.close()
        torch.cuda.empty_cache()
    assert raised.value.cause == "out_of_memory"  # type: ignore[attr-defined]
    assert "lower max_size" in str(raised.value)


# -- 8/9. Sizes: the largest batches never left uncaptured ------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_an_off_stride_largest_size_is_captured(device):
    # vllm-project/vllm-ascend#16049: max_num_seqs=12 left batches 9-12 eager (7.5x slower decode).
    runner = _runner(lambda x: x * 2, device, sizes=None, max_size=12)
    runner.capture()
    assert runner.bucket(12) == 12 and runner.bucket(9) == 12
    runner.run(x=torch.ones(11, WIDTH, device=device))
    stats = runner.stats()
    assert stats["replays"] == 1 and not any(stats["eager_by_reason"].values())


@pytest.mark.parametrize("device", DEVICES)
def test_a_spec_verify_maximum_is_never_truncated(device):
    # vllm-project/vllm#54933, #37865: 6 requests x (1 + 6) tokens = 42 truncated to 40, every verify eager.
    model = _tiny(device)
    runner = verify_runner(model, 7, mode="full", max_size=42, progress=False)
    runner.capture()
    assert 42 in [key.tokens for key in runner.keys]
    runner.run(**make_verify_batch(model, 6, 7))
    stats = runner.stats()
    assert stats["replays"] == 1 and not any(stats["eager_by_reason"].values())
    with pytest.raises(devgraph.ConfigError, match="multiples of tokens_per_request=7"):
        verify_runner(model, 7, mode="full", sizes=[7, 40], progress=False)


# -- 10. Random numbers from a generator the graph does not know (pytorch/pytorch#172390) ----------------
@pytest.mark.parametrize("device", DEVICES)
def test_a_forward_drawing_from_its_own_generator_is_stopped_at_capture(device):
    generator = torch.Generator(device=device).manual_seed(0)
    runner = _runner(lambda x: x + torch.rand(x.shape, device=x.device, generator=generator), device)
    with pytest.raises(
        CaptureError, match="torch.Generator of the forward's own.*default generator"
    ) as raised:
        runner.capture()
    assert raised.value.cause == "unregistered_generator"  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", DEVICES)
def test_the_default_generator_draws_new_numbers_at_every_replay(device):
    runner = _runner(lambda x: x + torch.rand(x.shape, device=x.device), device)
    runner.capture()
    x = torch.zeros(4, WIDTH, device=device)
    first, second = runner.run(x=x, copy=True), runner.run(x=x, copy=True)
    assert not torch.equal(first, second)


# -- 11. A side stream's memory reused inside the graph (NVIDIA/TensorRT-LLM#12847, #13354, #15265) -------
def _two_streams(record: bool) -> Any:
    side = torch.cuda.Stream()

    def forward(x: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = torch.tanh(x) * 2  # made on the side stream (a MoE's shared experts, overlapped)
        main.wait_stream(side)
        if record:
            shared.record_stream(main)
        return x + shared  # used on the main stream, then freed: no record_stream, memory handed back

    return forward


@pytest.mark.cuda
def test_a_tensor_freed_across_streams_without_record_stream_is_stopped_at_capture():
    runner = _runner(_two_streams(record=False), "cuda")
    with pytest.raises(CaptureError, match="used on another stream and freed.*record_stream") as raised:
        runner.capture()
    assert raised.value.cause == "cross_stream_free"  # type: ignore[attr-defined]
    fixed = _runner(_two_streams(record=True), "cuda")
    fixed.capture()
    x = torch.randn(4, WIDTH, device="cuda")
    assert fixed.verify(x=x).ok


def test_on_the_simulator_one_stream_runs_everything():
    # The class needs two streams running at once; the simulator runs every op in issue order on one, and
    # its observed run reports no stream hazard for a forward that switches its (simulated) streams.
    from devgraph.runner.guard import observe

    platform = devgraph.get_registry().platform("cpu")
    side = platform.new_stream()

    def forward() -> torch.Tensor:
        with platform.stream(side):
            shared = torch.ones(4) * 2
        return shared + 1

    assert observe(forward).hazards == ()


# -- 12. A library workspace in a module global, re-made after capture (NVIDIA/TensorRT-LLM#15534) --------
_WORKSPACE: dict[str, torch.Tensor] = {}


def _gemm_with_workspace(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # cublas_mm allocated its workspace per call; a lazily made one kept in a module global is the same
    # address for the captured kernel only as long as the global holds that tensor.
    workspace = _WORKSPACE.setdefault(str(x.device), torch.zeros(WIDTH, device=x.device))
    return x @ w + workspace


@pytest.mark.parametrize("device", DEVICES)
def test_a_workspace_re_made_in_a_module_global_is_named(device):
    w = torch.randn(WIDTH, WIDTH, device=device)
    _WORKSPACE.clear()
    runner = _runner(lambda x: _gemm_with_workspace(x, w), device)
    runner.capture()
    runner.run(x=torch.ones(2, WIDTH, device=device))
    (made,) = _WORKSPACE  # the forward's own key ("cuda:0" on a GPU, not "cuda")
    _WORKSPACE[made] = torch.zeros(WIDTH, device=device)  # re-made (a size change)
    # The simulator's graph holds the old tensor ("replaced"); on a GPU nothing does ("freed").
    with pytest.raises(ReplayError, match=r"_WORKSPACE\[.*\] .* was (replaced|freed)"):
        runner.run(x=torch.ones(2, WIDTH, device=device))


# -- 13. Padding rows writing into a live KV slot (sgl-project/sglang#7233) -------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_never_write_a_live_cache_slot(device):
    model = _tiny(device)
    runner = decode_runner(model, mode="full", sizes=[4], progress=False)
    runner.capture()

    def slots(cache: torch.Tensor) -> torch.Tensor:  # [blocks, block_size, ...] -> one row per slot
        return cache.reshape(cache.shape[0] * cache.shape[1], -1)

    caches = [slots(layer.k_cache).clone() for layer in model.layers]
    batch = make_decode_batch(model, 3, seq_lens=5)  # padded to 4: one padding row
    runner.run(**batch)
    live = set(batch["slot_mapping"].tolist())
    block = model.layers[0].k_cache.shape[1]
    assert model.padding_slot // block not in {slot // block for slot in live}  # a scratch block
    for before, layer in zip(caches, model.layers, strict=True):
        changed = set((before != slots(layer.k_cache)).any(1).nonzero().flatten().tolist())
        # The live rows wrote their slots; the padding row wrote the scratch slot only (whether that slot
        # changes depends on what the capture's warm-ups already wrote there: on a GPU the same values).
        assert live <= changed <= live | {model.padding_slot}, changed


# -- 14. Inputs at new addresses every step (vllm-project/vllm#42304) -------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_inputs_at_new_addresses_every_step_are_copied_in(device):
    w = torch.randn(WIDTH, WIDTH, device=device)
    runner = _runner(lambda x: torch.tanh(x @ w), device)
    runner.capture()
    for n in (2, 3, 4):
        x = torch.randn(n, WIDTH, device=device)  # a new tensor, a new address, every step
        torch.testing.assert_close(runner.run(x=x), torch.tanh(x @ w))


# -- A host tensor of a device runner re-made each step ---------------------------------------------------
@dataclasses.dataclass
class StepCounter:
    step: torch.Tensor


def test_a_host_tensor_re_made_with_the_same_values_is_named_as_such():
    # A device runner's forward read context.step (a CPU tensor) at capture. A new tensor of the same value
    # may still be a hazard (a captured copy from host memory reads the old tensor's memory), so the guard
    # stops the replay, and says what differs and the one fix that is right either way.
    values = HostValues("decode", host_device=True)
    key = GraphKey(tokens=1)
    record = values.recording(lambda key: StepCounter(torch.tensor(3)))
    assert record is not None
    int(record(key).during_capture().step)
    with pytest.raises(
        ReplayError, match="another host tensor than at capture, with the same values"
    ) as info:
        values.check(key, StepCounter(torch.tensor(3)))
    assert "refill it in place" in str(info.value)
    with pytest.raises(ReplayError, match="another tensor than at capture"):
        values.check(key, StepCounter(torch.tensor(4)))
