"""What handing one step to the other tensor-parallel ranks costs: the shared-memory step channel of
``devgraph serve --tp`` against the pickle broadcast over gloo it replaced, on the same batches.

    python benchmarks/bench_tp_channel.py                      # the CPU: rank 0 + 1 worker process
    python benchmarks/bench_tp_channel.py --device cuda        # 2 GPUs: inputs land on cuda:0 and cuda:1

Batches (the reference engine's inputs, built here from a seed): a decode step of 1 request and of 256
requests (contexts up to 2048 tokens, 16-token blocks: block tables 128 wide), and a prefill step of 2048
tokens over 8 requests, each with its rows of the device's block tables and the entries written since the
last step, as the engine sends them; and the 256-request decode step with its whole block table
(``decode_256_whole_tables``), as every step carried it before the device kept its own copy. Each is
sent ``--steps`` times, one every ``--gap-us`` (the worker waits between steps as it does while the GPU
runs one), through

- ``shm_spin`` and ``shm_park``: :func:`devgraph.serve.engine.wire.encode_step` +
  :class:`devgraph.serve.tp.channel.StepChannel`, the worker's
  :class:`~devgraph.serve.tp.channel.WorkerChannel` + ``inputs`` + ``context()``, every message in reused
  memory on both ranks (:class:`~devgraph.serve.engine.message_memory.MessageMemory`); the worker
  polling between steps (the default: it spins for half a second after each message), or parked on its
  doorbell at once (``DEVGRAPH_TP_SPIN_S=0``);
- ``shm_spin_fresh``: ``shm_spin`` with a new pinned buffer, device copy and views every step (the
  engine's way before the reused memory);
- ``gloo``: the previous channel: ``broadcast_object_list`` of the inputs and the context (pickled), after
  a ``.cpu()`` of each input (the engine used to build them on the device), ``.to(device)`` of each on the
  worker.

Per step: rank 0's host microseconds (encode, send, its own copy to its device), and the one-way latency:
from rank 0 starting the step to the worker holding the inputs on its device (monotonic clock, the same on
every process of a host; on a GPU after the worker's copy finished). The worker checks that what it got
equals the batch (every input, bit for bit, and the context) on every 50th step of each case. JSON to
``--out`` (default ``benchmarks/results/<device>-tp-channel.json``): device, torch, the command, medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from devgraph.reference.inputs import StepContext
from devgraph.serve.engine.message_memory import MessageMemory
from devgraph.serve.engine.wire import STOP, encode_step
from devgraph.serve.tp.channel import StepChannel, WorkerChannel

BLOCK, WIDTH = 16, 128  # 16-token blocks, contexts up to 2048 tokens
CASES = ("decode_1", "decode_256", "decode_256_whole_tables", "prefill_2048")
CHECK_EVERY = 50
#: The worker's wait: polling for half a second after each step (the default), or parked on its doorbell
#: at once (DEVGRAPH_TP_SPIN_S=0: what a host with more runnable threads than cores wants); and the
#: message memory: reused buffers (MessageMemory, what the engine and the workers use) or a new pinned
#: buffer, a new device copy and new views every step (``shm_spin_fresh``: how it was done before).
SHM_MODES = {"shm_spin": (0.5, True), "shm_park": (0.0, True), "shm_spin_fresh": (0.5, False)}


def make_batch(case: str, seed: int = 0) -> tuple[str, dict[str, torch.Tensor], StepContext]:
    """The engine's inputs for ``case`` (host tensors, as the engine builds them): the step's rows of the
    device's block tables (``table_rows``) and the entries written since the previous step (a decode step:
    one request in 16 crossed a block boundary; a prefill step: every block of its chunks); or, for a case
    ending in ``_whole_tables``, the whole ``[R, 128]`` block table as every step carried it before."""
    generator = torch.Generator().manual_seed(seed)
    whole = case.endswith("_whole_tables")
    if case.startswith("decode"):
        requests = int(case.split("_")[1])
        lens = torch.randint(64, BLOCK * WIDTH, (requests,), generator=generator).tolist()
        chunks = [1] * requests
    else:
        requests, tokens = 8, int(case.split("_")[1])
        chunks = [tokens // requests] * requests
        lens = [c + int(torch.randint(0, 512, (1,), generator=generator)) for c in chunks]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables = torch.zeros(requests, WIDTH, dtype=torch.int32)
    written: list[int] = []  # flat indices of the entries this step wrote
    cu = [0]
    next_block = 1
    for r, (length, chunk) in enumerate(zip(lens, chunks, strict=True)):
        blocks = list(range(next_block, next_block + -(-length // BLOCK)))
        next_block += len(blocks)
        tables[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if chunk > 1:  # a prefill chunk: the blocks its tokens fill are new
            first = (length - chunk) // BLOCK
            written += [r * WIDTH + b for b in range(first, len(blocks))]
        elif r % 16 == 0:  # a decode step crossing a block boundary
            written.append(r * WIDTH + len(blocks) - 1)
        for p in range(length - chunk, length):
            ids.append(int(torch.randint(0, 32000, (1,), generator=generator)))
            positions.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        cu.append(cu[-1] + chunk)
    inputs = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }
    if whole:
        inputs["block_tables"] = tables
    else:
        inputs["table_rows"] = torch.arange(requests, dtype=torch.int64)
        inputs["table_at"] = torch.tensor(written, dtype=torch.int64)
        inputs["table_values"] = tables.view(-1)[inputs["table_at"]]
    if case.startswith("prefill"):
        inputs["cu_seqlens_q"] = torch.tensor(cu, dtype=torch.int32)
        return "prefill", inputs, StepContext(seq_lens=lens, cu_seqlens_q=cu)
    return "decode", inputs, StepContext(seq_lens=lens)


def _columns(context: StepContext) -> dict[str, int]:
    """Where a step still carries whole tables: the columns its longest request reads."""
    return {"block_tables": -(-max(context.seq_lens or [1]) // BLOCK)}


def _stats(values_ns: list[int]) -> dict[str, float]:
    ordered = sorted(values_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3  # noqa: E731
    return {
        "median_us": round(statistics.median(ordered) / 1e3, 2),
        "p90_us": round(pick(0.9), 2),
        "p99_us": round(pick(0.99), 2),
        "min_us": round(ordered[0] / 1e3, 2),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pace(deadline_ns: int) -> None:
    """Wait until ``deadline_ns`` (rank 0 waiting on its GPU): asleep, then the last 200 us spinning."""
    left = deadline_ns - time.monotonic_ns()
    if left > 300_000:
        time.sleep((left - 200_000) / 1e9)
    while time.monotonic_ns() < deadline_ns:
        pass


def _same(got: dict[str, torch.Tensor], context: StepContext, batch: Any) -> bool:
    _, expected, expected_context = batch
    inputs_equal = all(torch.equal(got[k].cpu(), v) for k, v in expected.items()) and set(got) == set(
        expected
    )
    return inputs_equal and context == expected_context


def worker(rank: int, port: int, ring: str, device_name: str, args: dict[str, Any], results: Any) -> None:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = WorkerChannel(ring, rank, pin=device.type == "cuda")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args["ranks"],
        timeout=timedelta(seconds=60),
    )
    out: dict[str, Any] = {}
    batches = {case: make_batch(case) for case in CASES}
    for case in CASES:
        for mode, (spin, reuse) in SHM_MODES.items():
            channel.ring.spin_s = spin
            memory = MessageMemory(device) if reuse else None
            latencies, checked, equal = [], 0, True
            for i in range(args["warmup"] + args["steps"]):
                if memory is not None:
                    message = channel.receive(memory.host_buffer)
                    inputs = memory.inputs(message)
                else:
                    message = channel.receive()
                    inputs = message.inputs(device)
                context = message.context()
                _sync(device)
                arrived = time.monotonic_ns()
                if i >= args["warmup"]:
                    latencies.append(arrived - message.step)
                if i % CHECK_EVERY == 0:
                    checked += 1
                    equal &= _same(inputs, context, batches[case])
            out[f"{mode}/{case}"] = {"latency_ns": latencies, "checked": checked, "equal": equal}
        latencies, checked, equal = [], 0, True
        for i in range(args["warmup"] + args["steps"]):
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            _, kind, host, context, sent = box[0]
            inputs = {k: v.to(device) for k, v in host.items()}
            _sync(device)
            arrived = time.monotonic_ns()
            if i >= args["warmup"]:
                latencies.append(arrived - sent)
            if i % CHECK_EVERY == 0:
                checked += 1
                equal &= _same(inputs, context, batches[case])
        out[f"gloo/{case}"] = {"latency_ns": latencies, "checked": checked, "equal": equal}
    assert channel.receive().kind == STOP
    results.put((rank, out))
    channel.close()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    pin = device.type == "cuda"
    if pin:
        torch.cuda.set_device(device)
    port = _free()
    channel = StepChannel(args.ranks)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    shared = {"ranks": args.ranks, "steps": args.steps, "warmup": args.warmup}
    workers = []
    for rank in range(1, args.ranks):
        name = f"cuda:{rank}" if pin else "cpu"
        process = context.Process(target=worker, args=(rank, port, str(channel.path), name, shared, results))
        process.start()
        workers.append(process)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=args.ranks,
        timeout=timedelta(seconds=60),
    )
    gap = int(args.gap_us * 1e3)
    data: dict[str, Any] = {"cases": {}}
    for case in CASES:
        kind, inputs, step_context = make_batch(case)
        columns = _columns(step_context)
        shm: dict[str, Any] = {}
        size = 0
        for mode, (_, reuse) in SHM_MODES.items():
            timings: dict[str, list[int]] = {"encode": [], "send": [], "to_device": [], "total": []}
            memory = MessageMemory(device) if reuse else None
            allocate = memory.host_buffer if memory is not None else None
            for i in range(args.warmup + args.steps):
                start = time.monotonic_ns()
                message = encode_step(
                    kind, inputs, step_context, step=start, columns=columns, pin=pin, allocate=allocate
                )
                encoded = time.monotonic_ns()
                channel.send(message)
                sent = time.monotonic_ns()
                # rank 0's own copy (non-blocking on a GPU)
                memory.inputs(message) if memory is not None else message.inputs(device)
                done = time.monotonic_ns()
                size = int(message.buffer.numel())
                if i >= args.warmup:
                    for key, value in (
                        ("encode", encoded - start),
                        ("send", sent - encoded),
                        ("to_device", done - sent),
                    ):
                        timings[key].append(value)
                    timings["total"].append(done - start)
                _pace(start + gap)
            shm[mode] = {f"rank0_{k}": _stats(v) for k, v in timings.items()}
            shm[mode]["message_bytes"] = size
            _pace(time.monotonic_ns() + 50_000_000)  # the worker switches mode between two passes
        on_device = {k: v.to(device) for k, v in inputs.items()}  # the old engine built them on the device
        _sync(device)
        timings = {"send": [], "total": []}
        pickled = 0
        for i in range(args.warmup + args.steps):
            start = time.monotonic_ns()
            host = {k: v.cpu() for k, v in on_device.items()}
            payload = ("step", kind, host, step_context, start)
            if i == 0:
                import pickle

                pickled = len(pickle.dumps(payload))
            dist.broadcast_object_list([payload], src=0)
            sent = time.monotonic_ns()
            if i >= args.warmup:
                timings["send"].append(sent - start)
                timings["total"].append(sent - start)
            _pace(start + gap)
        gloo = {f"rank0_{k}": _stats(v) for k, v in timings.items()}
        data["cases"][case] = {
            "requests": len(step_context.seq_lens or []),
            "tokens": int(inputs["input_ids"].numel()),
            **shm,
            "gloo": {**gloo, "pickle_bytes": pickled},
        }
        print(f"{case}: shm message {size} bytes, gloo pickle {pickled} bytes", flush=True)
    channel.send_stop()
    for _ in workers:
        rank, out = results.get(timeout=120)
        for key, value in out.items():
            path, case = key.split("/")
            entry = data["cases"][case][path]
            entry[f"one_way_rank{rank}"] = _stats(value["latency_ns"])
            entry[f"checked_rank{rank}"] = {"steps": value["checked"], "equal": value["equal"]}
    for process in workers:
        process.join(30)
    channel.close()
    dist.destroy_process_group()
    return data


def _free() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _device_name(device: str) -> str:
    if device == "cuda":
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="rank 0 + workers (default 2)")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per case and channel")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--gap-us", type=float, default=1000.0, help="microseconds from one step to the next")
    parser.add_argument("--out", help="the JSON path")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"--device cuda needs {args.ranks} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    began = time.monotonic()
    data = {
        "device": _device_name(args.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", *map(shlex.quote, sys.argv if argv is None else [__file__, *argv])]),
        "load_average_before": os.getloadavg(),
        "definition": (
            "rank0_*: host microseconds rank 0 spends per step (encode: the step as bytes; send: into the "
            "ring "
            "/ the gloo broadcast incl. pickling; to_device: its own copy of the inputs to its device, "
            "non-blocking; total: all three). one_way_rankN: from rank 0 starting the step to rank N "
            "holding its inputs on its device (and the context on the host). Medians of --steps steps."
        ),
        **run(args),
    }
    data["load_average_after"] = os.getloadavg()
    data["seconds"] = round(time.monotonic() - began, 1)
    best = min(
        (data["cases"]["decode_256"][mode].get("one_way_rank1", {}).get("median_us", 1e9), mode)
        for mode in SHM_MODES
    )
    data["target"] = {
        "what": "shm one-way median at 256 requests <= 30 us (the better waiting mode)",
        "value_us": best[0],
        "mode": best[1],
        "met": best[0] <= 30,
    }
    default = f"benchmarks/results/{'cpu' if args.device == 'cpu' else 'gpu'}-tp-channel.json"
    out = Path(
        args.out or (Path(os.environ["OUT"]) / "tp-channel.json" if os.environ.get("OUT") else default)
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    for case, entry in data["cases"].items():
        line = [f"{case:>13}"]
        for mode in (*SHM_MODES, "gloo"):
            one_way = entry[mode].get("one_way_rank1", {}).get("median_us")
            line.append(f"{mode} one-way {one_way} us (rank 0 {entry[mode]['rank0_total']['median_us']} us)")
        print(" | ".join(line))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
