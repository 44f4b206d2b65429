"""The step channel of ``devgraph serve --tp``: a step as bytes (``wire``), the shared-memory ring
(``ring``), and the channel's lost-rank rules (``channel``); the step timeline the serving benchmarks read.

Readers run in this process (the ring does not care which process reads), except where a rank's death is
the point: then rank 0 is a subprocess that is killed or stopped. ``multi_gpu``: the same bytes land on
two GPUs, rank 0's and a worker's, equal to the batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from devgraph.reference.inputs import StepContext, make_decode_batch
from devgraph.serve.engine.wire import STOP, TRIM_MIN_BYTES, decode_step, encode_step
from devgraph.serve.tp.channel import RankLost, StepChannel, WorkerChannel
from devgraph.serve.tp.ring import RingReader, RingWriter

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def _step(requests: int, width: int = 128, used: int = 40) -> tuple[dict[str, torch.Tensor], StepContext]:
    """A decode step as the engine builds it: host tensors, block tables zero past each request's blocks."""
    generator = torch.Generator().manual_seed(requests)
    tables = torch.zeros(requests + 1, width, dtype=torch.int32)  # + a padding row of zeros
    tables[:requests, :used] = torch.randint(
        1, 5000, (requests, used), generator=generator, dtype=torch.int32
    )
    lens = torch.randint(1, used * 16, (requests,), generator=generator).tolist()
    inputs = {
        "input_ids": torch.randint(0, 32000, (requests + 1,), generator=generator),
        "positions": torch.tensor([n - 1 for n in lens] + [0]),
        "slot_mapping": torch.randint(16, 80000, (requests + 1,), generator=generator),
        "block_tables": tables,
        "seq_lens": torch.tensor(lens + [0], dtype=torch.int32),
    }
    return inputs, StepContext(seq_lens=lens)


def _host(buffer: int) -> torch.Tensor:
    return torch.empty(buffer, dtype=torch.uint8)


def _never() -> None:
    return None


# -- the wire ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("requests", [1, 256])
def test_a_step_crosses_the_wire_bit_for_bit(requests: int) -> None:
    inputs, context = _step(requests)
    inputs["flags"] = torch.tensor([True, False, True])
    inputs["scale"] = torch.randn(3, 2, dtype=torch.bfloat16)
    context.cu_seqlens_q = list(range(requests + 1))
    message = encode_step("prefill", inputs, context, step=42, columns={"block_tables": 40})
    received = decode_step(message.buffer.clone())  # a copy: what a worker reads out of the ring
    assert (received.kind, received.step) == ("prefill", 42)
    got = received.inputs(torch.device("cpu"))
    assert list(got) == list(inputs)
    for name, tensor in inputs.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert received.context() == context


def test_block_table_columns_no_step_reads_stay_off_the_wire_and_come_back_as_zeros() -> None:
    inputs, context = _step(256, width=512, used=40)  # long contexts allowed, short ones served
    whole = encode_step("decode", inputs, context)
    trimmed = encode_step("decode", inputs, context, columns={"block_tables": 40})
    saved = 257 * (512 - 40) * 4
    assert saved >= TRIM_MIN_BYTES
    assert whole.buffer.numel() - trimmed.buffer.numel() >= saved - 64
    assert torch.equal(
        decode_step(trimmed.buffer).inputs(torch.device("cpu"))["block_tables"], inputs["block_tables"]
    )
    # A few kilobytes are cheaper to copy whole than to cut: the narrow table goes as it is.
    small, small_context = _step(4, width=128, used=3)
    untouched = encode_step("decode", small, small_context, columns={"block_tables": 3})
    assert untouched.buffer.numel() == encode_step("decode", small, small_context).buffer.numel()


def test_device_tensors_and_strided_inputs_are_encoded_too() -> None:
    inputs, context = _step(3)
    strided = {
        "block_tables": inputs["block_tables"].t().contiguous().t(),
        "input_ids": inputs["input_ids"][::1],
    }
    got = decode_step(encode_step("decode", strided, context).buffer).inputs(torch.device("cpu"))
    assert torch.equal(got["block_tables"], inputs["block_tables"])
    assert torch.equal(got["input_ids"], inputs["input_ids"])


def test_python_int_arrays_cross_as_int64_and_int32_and_other_codes_are_refused() -> None:
    from array import array

    inputs = {"at": array("q", [3, 2**40, -1]), "values": array("i", [7, -8, 9]), "none": array("q")}
    message = decode_step(encode_step("decode", inputs, None).buffer)
    got = message.inputs(torch.device("cpu"))
    assert got["at"].dtype == torch.int64 and got["at"].tolist() == [3, 2**40, -1]
    assert got["values"].dtype == torch.int32 and got["values"].tolist() == [7, -8, 9]
    assert got["none"].shape == (0,)
    for code in ("d", "h", "B"):
        with pytest.raises(TypeError, match=f"type code '{code}'"):
            encode_step("decode", {"x": array(code, [1])}, None)


def test_what_is_not_a_step_message_is_refused_in_words() -> None:
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_step(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a step message"):
        decode_step(torch.zeros(256, dtype=torch.uint8))
    message = encode_step("decode", *_step(2))
    with pytest.raises(ValueError, match="runs past the end"):
        decode_step(message.buffer[: message.buffer.numel() - 64].clone())
    with pytest.raises(TypeError, match="cannot go on the wire"):
        encode_step("decode", {"x": torch.zeros(1, 1, 1, 1, 1)}, None)


# -- the ring ---------------------------------------------------------------------------------------------
def test_every_reader_gets_every_message_in_order_long_ones_over_several_slots() -> None:
    writer = RingWriter(readers=2, slots=3, capacity=1024)
    readers = [RingReader(writer.path, r) for r in range(2)]
    sizes = [0, 1, 1024, 1025, 5000, 17, 3 * 1024 + 1] * 4  # longer than a slot, longer than the ring
    messages = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    got: list[list[torch.Tensor]] = [[], []]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].read(_host, _never))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for message in messages:
        writer.write(message, _never)
    for thread in threads:
        thread.join(30)
    assert writer.attached()
    for r in range(2):
        assert [m.numel() for m in got[r]] == sizes
        assert all(torch.equal(a, b) for a, b in zip(got[r], messages, strict=True))
    for reader in readers:
        reader.close()
    writer.close()
    assert not writer.path.exists()


def test_a_full_ring_waits_for_the_slowest_reader_and_checks_while_it_waits() -> None:
    writer = RingWriter(readers=1, slots=2, capacity=64)
    reader = RingReader(writer.path, 0)
    writer.write(torch.ones(10, dtype=torch.uint8), _never)
    writer.write(torch.ones(10, dtype=torch.uint8), _never)
    calls = []

    def give_up() -> None:
        calls.append(time.monotonic())
        if len(calls) >= 3:
            raise TimeoutError("no reader")

    with pytest.raises(TimeoutError):
        writer.write(torch.ones(10, dtype=torch.uint8), give_up)  # both slots unread
    assert writer.unread(0.0) == {0: 0}
    reader.read(_host, _never)
    writer.write(torch.full((10,), 7, dtype=torch.uint8), _never)  # slot 0 is free again
    assert torch.equal(reader.read(_host, _never), torch.ones(10, dtype=torch.uint8))
    assert int(reader.read(_host, _never)[0]) == 7
    reader.close()
    writer.close()


# -- the channel: lost ranks ------------------------------------------------------------------------------
def test_a_worker_that_stops_reading_is_found_and_a_send_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEVGRAPH_RANK_TIMEOUT_S", "0.3")
    channel = StepChannel(2, slots=2, capacity=4096)
    worker = WorkerChannel(channel.path, 1)  # attached, never reads: alive but stuck
    message = encode_step("decode", *_step(1))
    channel.send(message)
    assert channel.stalled() is None  # just sent
    time.sleep(0.4)
    assert channel.stalled() is None  # a first look is confirmed on the next one (same step)
    reason = channel.stalled()
    assert reason and "rank(s) 1 left a step unread" in reason and "DEVGRAPH_RANK_TIMEOUT_S=0.3" in reason
    channel.send(message)
    began = time.monotonic()
    with pytest.raises(RankLost, match=r"rank\(s\) 1 took no step for 0.3 s"):
        channel.send(message)  # the ring is full
    assert time.monotonic() - began < 2
    worker.close()
    channel.close()


def test_abort_ends_a_waiting_send_at_once_and_the_workers_see_the_close() -> None:
    channel = StepChannel(2, slots=1, capacity=4096)
    worker = WorkerChannel(channel.path, 1)
    deadline = time.monotonic() + 5
    while channel.path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not channel.path.exists()  # every worker mapped it: its name is gone
    message = encode_step("decode", *_step(1))
    channel.send(message)
    threading.Timer(0.2, channel.abort, ("the server is stopping: rank 1 exited",)).start()
    began = time.monotonic()
    with pytest.raises(RankLost, match="rank 1 exited"):
        channel.send(message)
    assert time.monotonic() - began < 1.5
    assert worker.receive().kind == "decode"
    channel.close()
    with pytest.raises(RankLost, match="closed the step channel"):
        worker.receive()
    worker.close()


_RANK0 = """
import sys, time
from devgraph.serve.tp.channel import StepChannel
from devgraph.serve.engine.wire import encode_step
from devgraph.reference.inputs import StepContext
import torch
channel = StepChannel(2)
print(channel.path, flush=True)
sys.stdin.readline()
channel.send(encode_step("decode", {"input_ids": torch.arange(3)}, StepContext(seq_lens=[1, 2, 3])))
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_worker_finds_rank_0_gone(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed: seen at once (its pid is gone). Stopped (alive, silent): its heartbeat ages past the rank
    timeout."""
    monkeypatch.setenv("DEVGRAPH_RANK_TIMEOUT_S", "1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _RANK0], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert rank0.stdout is not None and rank0.stdin is not None
        worker = WorkerChannel(rank0.stdout.readline().strip(), 1)
        rank0.stdin.write("go\n")
        rank0.stdin.flush()
        first = worker.receive()
        assert first.kind == "decode" and first.context().seq_lens == [1, 2, 3]
        os.kill(rank0.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        began = time.monotonic()
        silent = r"has not been heard from for [\d.]+ s \(DEVGRAPH_RANK_TIMEOUT_S=1 s\)"
        expected = "exited" if how == "killed" else silent
        with pytest.raises(RankLost, match=expected):
            worker.receive()
        waited = time.monotonic() - began
        assert waited < (1.0 if how == "killed" else 3.0), waited
        worker.close()
    finally:
        rank0.kill()
        rank0.wait()


def test_the_stop_message() -> None:
    channel = StepChannel(2)
    worker = WorkerChannel(channel.path, 1)
    channel.send_stop()
    assert worker.receive().kind == STOP
    worker.close()
    channel.close()


# -- the step timeline ------------------------------------------------------------------------------------
def test_the_timeline_records_each_step_of_a_runner(tiny_model, tmp_path: Path) -> None:
    from devgraph.reference.runners import decode_runner
    from devgraph.serve.engine.timeline import StepTimeline

    runner = decode_runner(tiny_model, mode="full", sizes=[2, 4])
    runner.capture()
    timeline = StepTimeline(torch.device("cpu"), tmp_path / "timeline.json")
    timeline.wrap(runner, "decode")
    for size in (1, 3, 4):
        runner.run(**make_decode_batch(tiny_model, size, seed=size))
    timeline.save()
    steps = json.loads((tmp_path / "timeline.json").read_text())["steps"]
    assert [(s["phase"], s["tokens"], s["requests"]) for s in steps] == [("decode", n, n) for n in (1, 3, 4)]
    assert all(s["device_end_ms"] > s["device_start_ms"] for s in steps)
    assert all(b["device_start_ms"] >= a["device_end_ms"] for a, b in zip(steps, steps[1:], strict=False))
    assert all(b["host_s"] > a["host_s"] for a, b in zip(steps, steps[1:], strict=False))
    runner.close()


# -- two GPUs ---------------------------------------------------------------------------------------------
_GPU_WORKER = """
import sys, torch
from devgraph.serve.tp.channel import WorkerChannel
torch.cuda.set_device(1)
worker = WorkerChannel(sys.argv[1], 1, pin=True)
sums = []
while True:
    message = worker.receive()
    if message.kind == "stop":
        break
    inputs = message.inputs(torch.device("cuda:1"))
    assert all(t.device == torch.device("cuda:1") for t in inputs.values())
    sums.append([int(t.long().sum()) for t in inputs.values()] + [sum(message.context().seq_lens)])
print(sums, flush=True)
"""


@pytest.mark.multi_gpu
def test_steps_reach_a_worker_on_another_gpu_equal_to_the_batch() -> None:
    """Rank 0 on cuda:0 (pinned buffers, one non-blocking copy each) and a worker process on cuda:1 get
    the same inputs from the same bytes, step after step, with long and short batches in between."""
    channel = StepChannel(2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    worker = subprocess.Popen(
        [sys.executable, "-c", _GPU_WORKER, str(channel.path)], stdout=subprocess.PIPE, text=True, env=env
    )
    expected = []
    for step in range(60):
        inputs, context = _step([1, 256, 7][step % 3], width=512)
        message = encode_step("decode", inputs, context, step=step, columns={"block_tables": 40}, pin=True)
        channel.send(message)
        on_gpu = message.inputs(torch.device("cuda:0"))
        for name, tensor in inputs.items():
            assert on_gpu[name].device == torch.device("cuda:0")
            assert torch.equal(on_gpu[name].cpu(), tensor), name
        expected.append([int(t.long().sum()) for t in inputs.values()] + [sum(context.seq_lens)])
    channel.send_stop()
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert json.loads(out.strip()) == expected
    channel.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_ring_left_by_a_killed_rank_0_is_removed_by_the_next_one():
    """A rank 0 killed before its workers attached leaves its ring file in /dev/shm (4 MiB of memory that is
    never freed): the next ring removes files of processes that are gone, once they are a minute old."""
    import gc

    from devgraph.ranks.shared_board import shm_directory
    from devgraph.serve.tp.ring import RING_PREFIX

    directory = shm_directory()
    dead, alive = _dead_pid(), os.getppid()
    stale = directory / f"{RING_PREFIX}{dead}-feedface0001"
    young = directory / f"{RING_PREFIX}{dead}-feedface0002"
    living = directory / f"{RING_PREFIX}{alive}-feedface0003"
    for path in (stale, young, living):
        path.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(living, (old, old))
    try:
        writer = RingWriter(readers=1, slots=2, capacity=64)
        assert not stale.exists() and young.exists() and living.exists()
        own = writer.path
        assert own.exists()
        del writer  # never attached: its name goes with it
        gc.collect()
        assert not own.exists()
    finally:
        for path in (stale, young, living):
            path.unlink(missing_ok=True)
