"""The server's per-token host path, piece by piece, in-process: the outbox and the mailboxes that hand a
step's outputs to the event loop, the stream's pre-serialised chunk events, the mirrored TPOT histogram
and the decode batch's inlined hot loop (each against what it replaced)."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from devgraph.serve.api import generate
from devgraph.serve.api.generate import Mailbox, Outbox, _ChunkEncoder, _encoded
from devgraph.serve.engine.allocator import BlockTables
from devgraph.serve.engine.batch import _ids, _slots, decode_batch
from devgraph.serve.engine.request import FinishReason, Request, RequestOutput, SamplingParams

pytestmark = [pytest.mark.timeout(60)]


def _output(group: str, token: int, finished: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    return RequestOutput(group, [token], finished=finished, finish_reason=reason)


def test_a_mailbox_hands_every_output_that_arrived_in_one_take_in_order() -> None:
    async def main() -> list[list[int]]:
        mailbox = Mailbox()
        taken: list[list[int]] = []
        reader = asyncio.ensure_future(mailbox.take())
        await asyncio.sleep(0)  # the reader waits: nothing is there yet
        assert not reader.done()
        mailbox.put(_output("a", 1))
        mailbox.put(_output("a", 2))
        taken.append([o.token_ids[0] for o in await reader])
        mailbox.put(_output("a", 3))
        taken.append([o.token_ids[0] for o in await mailbox.take()])  # no wait: one is there
        return taken

    assert asyncio.run(main()) == [[1, 2], [3]]


def test_the_outbox_delivers_outputs_put_from_another_thread_in_order_with_few_wakeups() -> None:
    async def main() -> tuple[dict[str, list[int]], int]:
        loop = asyncio.get_running_loop()
        outbox = Outbox(loop)
        flushes = 0
        flush = outbox._flush

        def counted() -> None:
            nonlocal flushes
            flushes += 1
            flush()

        outbox._flush = counted  # type: ignore[method-assign]
        boxes = {name: Mailbox() for name in ("a", "b")}

        def engine_thread() -> None:
            for step in range(200):
                for name, box in boxes.items():
                    outbox.put(box, _output(name, step, finished=step == 199))

        thread = threading.Thread(target=engine_thread)
        thread.start()
        got: dict[str, list[int]] = {name: [] for name in boxes}
        for name, box in boxes.items():
            while not got[name] or got[name][-1] != 199:
                got[name] += [o.token_ids[0] for o in await box.take()]
        thread.join()
        return got, flushes

    got, flushes = asyncio.run(main())
    assert got == {"a": list(range(200)), "b": list(range(200))}
    assert 1 <= flushes <= 400  # one per batch of puts, never one per output and more


@pytest.mark.parametrize("usage", [None, {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}])
@pytest.mark.parametrize("has_usage", [False, True])
def test_a_chunk_event_has_the_bytes_of_the_whole_payload_serialised(
    has_usage: bool, usage: dict[str, int] | None
) -> None:
    head = {"id": "cmpl-7", "object": "text_completion", "created": 1700000000, "model": 'tiny/\u00e9"x'}
    piece = {"index": 0, "text": "a\u00e9\n\"\ud83d\ude00", "token_ids": [97, 195], "logprobs": None,
             "finish_reason": None}  # fmt: skip
    payload: dict[str, Any] = {**head, "choices": [piece]}
    if has_usage:
        payload["usage"] = usage
    expected = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    assert _ChunkEncoder(head).encode([piece], has_usage, usage) == expected
    assert _encoded(payload) == expected


def test_a_run_reads_the_outputs_that_arrived_up_to_the_one_that_closed_it() -> None:
    """Outputs after the one that finished the last open choice are left unread, as when they were read
    one at a time."""

    class Engine:
        def abort(self, *args: Any) -> None:
            raise AssertionError("nothing is aborted")

    async def main() -> tuple[list[int], int]:
        from devgraph.serve.api.fields import Generation
        from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer

        generation = Generation([[1, 2]], SamplingParams(max_tokens=2), True, False, (), False, "tiny")
        run = generate._Run(SimpleNamespace(engine=Engine()), generation, ByteTokenizer())  # type: ignore[arg-type]
        run.groups["cmpl-0"] = 0
        mailbox = Mailbox()
        for output in (_output("cmpl-0", 104), _output("cmpl-0", 105, finished=True), _output("cmpl-0", 1)):
            mailbox.put(output)
        taken = await run.next(mailbox)
        return [t for _, _, o in taken for t in o.token_ids], run.open

    assert asyncio.run(main()) == ([104, 105], 0)


def test_the_tpot_histogram_is_the_itl_histogram_under_vllms_older_name() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.exposition import generate_latest

    from devgraph.serve.api.metrics import ServeMetrics

    metrics = ServeMetrics(lambda: {}, [], model_name="tiny")
    for itl in (0.0004, 0.003, 0.2, 90.0):
        metrics.observe(RequestOutput("a", [1], itl=itl), 1.0)
    names = metrics.registry._names_to_collectors
    lines = {}
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        text = generate_latest(SimpleNamespace(collect=names[name].collect)).decode()  # type: ignore[arg-type]
        lines[name] = [
            line.replace(name, "NAME") for line in text.splitlines() if not line.startswith("# HELP")
        ]
        assert f"# HELP {name} Time between two tokens" in text
        assert f'{name}_count{{engine="0",model_name="tiny"}} 4.0' in text
    itl, tpot = lines.values()
    assert tpot == itl  # every bucket, the count, the sum: the same observations


def test_the_decode_batch_puts_each_token_where_the_general_helpers_do() -> None:
    tables = BlockTables(4, 8)
    requests = []
    for i, (prompt, output, pending, computed) in enumerate(
        [(5, 0, 0, 4), (20, 3, 0, 22), (16, 0, 1, 16), (31, 2, 1, 33)]
    ):
        request = Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(), i)
        request.output = [400 + j for j in range(output)]
        request.pending, request.num_computed = pending, computed
        request.row = tables.acquire()
        request.blocks = [10 * i + b for b in range(3)]
        tables.write(request.row, 0, request.blocks)
        requests.append(request)
    batch = decode_batch(requests, tables, 16, padding_slot=7, pad_to=6)
    ids: list[int] = []
    from_slots: list[int] = []
    pending = [_ids(r, r.num_computed, 1, ids, from_slots) for r in requests]
    slots = [_slots(r, r.num_computed, 1, 16)[0] for r in requests]
    assert batch.inputs["input_ids"].tolist() == ids + [0, 0]
    assert batch.inputs["slot_mapping"].tolist() == slots + [7, 7]
    assert batch.inputs["positions"].tolist() == [r.num_computed for r in requests] + [0, 0]
    assert batch.inputs["seq_lens"].tolist() == [r.num_computed + 1 for r in requests] + [0, 0]
    assert pending == [False, False, True, True]
    assert batch.id_slots is not None
    assert batch.id_slots.tolist() == from_slots + [-1, -1]
    assert batch.inputs["input_ids"].dtype == torch.int64


class _Written:
    """A stream response that keeps what was written."""

    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(e[len(b"data: ") :]) for e in self.data.split(b"\n\n") if e]


def _stream_of(outputs: list[RequestOutput], *, n: int = 1, continuous: bool = False) -> list[dict[str, Any]]:
    """The events ``_events`` writes when ``outputs`` all arrive in one flush (the handler fell behind)."""
    from devgraph.serve.api.chat import ChatShape
    from devgraph.serve.api.fields import Generation
    from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer

    class Engine:
        def abort(self, *args: Any) -> None:
            raise AssertionError("nothing is aborted")

    async def main() -> list[dict[str, Any]]:
        generation = Generation(
            [[1, 2]], SamplingParams(max_tokens=4, n=n), True, continuous, (), False, "tiny", n=n,
            continuous_usage=continuous,
        )  # fmt: skip
        tokenizer = ByteTokenizer()
        run = generate._Run(SimpleNamespace(engine=Engine()), generation, tokenizer)  # type: ignore[arg-type]
        run.groups["cmpl-0"] = 0
        mailbox = Mailbox()
        for output in outputs:
            mailbox.put(output)
        response = _Written()
        await generate._events(response, run, ChatShape(tokenizer), mailbox, 1700000000)  # type: ignore[arg-type]
        return response.events()

    return asyncio.run(main())


def test_a_stream_that_fell_behind_ends_each_choice_in_its_last_chunk_only() -> None:
    """Two steps of one choice in one flush, the second ending it: each chunk is built after its own
    output, so only the last one carries the finish reason (an earlier one said "length" before the text
    that followed it, and a tool-call parser was fed its text as final)."""
    events = _stream_of([_output("cmpl-0", 104), _output("cmpl-0", 105, finished=True)])
    pieces = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert [(p["delta"]["content"], p["finish_reason"]) for p in pieces] == [("h", None), ("i", "length")]


def test_continuous_usage_counts_the_tokens_up_to_each_chunk_of_one_flush() -> None:
    outputs = [_output("cmpl-0", 104), _output("cmpl-0", 105), _output("cmpl-0", 106, finished=True)]
    events = _stream_of(outputs, continuous=True)
    completion = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert completion[-3:] == [1, 2, 3]


def test_a_failure_in_the_same_flush_as_tokens_streams_the_tokens_first() -> None:
    """The tokens a copy generated before the engine failed the request are sent, then the error: the
    failure, read in the same flush, was reported before (and instead of) the chunks that preceded it."""
    failed = RequestOutput("cmpl-0", [], finished=True, finish_reason=FinishReason.ERROR, error="boom")
    events = _stream_of([_output("cmpl-0", 104), failed])
    contents = [e["choices"][0]["delta"].get("content") for e in events if e.get("choices")]
    assert "h" in contents
    assert "boom" in json.dumps(events[-1])


def test_a_copy_ended_by_a_stop_string_sends_nothing_after_its_finish() -> None:
    """n=2, copy 0 reaches the stop string "i" while its next tokens are in flight (the abort takes a
    step): those outputs, and the abort's own, added chunks after its finish (three with finish_reason
    "stop") and counted their tokens in the usage; the engine was asked to abort it twice."""
    from devgraph.serve.api.chat import ChatShape
    from devgraph.serve.api.fields import Generation
    from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer

    aborted: list[tuple[Any, ...]] = []

    class Engine:
        def abort(self, *args: Any) -> None:
            aborted.append(args)

    def out(token: int | None, index: int, reason: FinishReason | None = None) -> RequestOutput:
        ids = [token] if token is not None else []
        return RequestOutput("cmpl-0", ids, reason is not None, reason, group="cmpl-0", index=index)

    async def main() -> list[dict[str, Any]]:
        params = SamplingParams(max_tokens=8, n=2)
        generation = Generation([[1, 2]], params, True, True, ("i",), False, "tiny", n=2)
        tokenizer = ByteTokenizer()
        run = generate._Run(Engine(), generation, tokenizer)  # type: ignore[arg-type]
        run.groups["cmpl-0"] = 0
        mailbox = Mailbox()
        for output in (out(104, 0), out(104, 1), out(105, 0), out(106, 1), out(106, 0),
                       out(None, 0, FinishReason.ABORT), out(107, 1, FinishReason.LENGTH)):  # fmt: skip
            mailbox.put(output)
        response = _Written()
        await asyncio.wait_for(generate._events(response, run, ChatShape(tokenizer), mailbox, 1), 10)  # type: ignore[arg-type]
        return response.events()

    events = asyncio.run(main())
    finishes = [(c["index"], c["finish_reason"]) for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == [(0, "stop"), (1, "length")]
    assert len(aborted) == 1
    assert events[-1]["usage"]["completion_tokens"] == 2 + 3  # h, i of copy 0; h, j, k of copy 1
