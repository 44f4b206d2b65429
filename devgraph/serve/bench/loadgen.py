"""``devgraph bench serve``: a seeded request trace sent to a running server over real HTTP.

The trace (prompt token ids and ``max_tokens`` per request) is drawn from ``--seed`` alone, so two
servers (one per ``--device-graph-mode``) get the same requests in the same order. Requests stream
(server-sent events); the client times the first token (TTFT) and every gap between tokens (ITL). Load
is either a fixed number of requests in flight (``--concurrency``) or Poisson arrivals
(``--request-rate``). Every request's output token ids are kept, so greedy runs of two modes can be
compared token for token.

Every request the load generator sends, the model card (``GET /v1/models``) included, gives up after
``--timeout`` seconds: a server that accepts connections and never answers cannot hang the run. A model
card that is not devgraph serve's is one :class:`~devgraph.errors.ConfigError` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from devgraph.messages import shorten
from devgraph.serve.api.protocol import ModelCard, parse_model_card
from devgraph.serve.bench.report import summarize, summary_table

__all__ = [
    "TraceRequest",
    "check_lengths",
    "fetch_model",
    "make_trace",
    "run_from_args",
    "run_load",
    "trace_lengths",
]


@dataclass(frozen=True)
class TraceRequest:
    index: int
    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None  # "HTTP 400", "stream error", "ClientConnectorError", ...: counted per kind
    sent_at: float = 0.0  # seconds since the run started
    ttft: float | None = None  # seconds
    token_times: list[float] = field(default_factory=list)  # seconds since this request was sent
    itl: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def check_lengths(prompt_len: tuple[int, int], output_len: tuple[int, int], max_seq_len: int) -> str | None:
    """:class:`ConfigError` when even the shortest prompt plus the shortest output cannot fit the server's
    context; a warning (to print) when the longest do not, and :func:`make_trace` will cut them."""
    from devgraph import ConfigError

    if prompt_len[0] + output_len[0] > max_seq_len:
        raise ConfigError(
            f"--prompt-len {_span(prompt_len)} and --output-len {_span(output_len)} cannot fit the server's "
            f"context of {max_seq_len} tokens (prompt + output); lower them"
        )
    if prompt_len[1] + output_len[1] > max_seq_len:
        return (
            f"prompts up to {prompt_len[1]} plus outputs up to {output_len[1]} tokens exceed the server's "
            f"context of {max_seq_len}: longer requests are cut to fit (the lengths sent are in the summary "
            "and the JSON)"
        )
    return None


def _span(bounds: tuple[int, int]) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}:{bounds[1]}"


def trace_lengths(trace: list[TraceRequest]) -> dict[str, dict[str, float]]:
    """Min, max and mean of the prompt and output lengths actually sent."""

    def spread(values: list[int]) -> dict[str, float]:
        return {"min": min(values), "max": max(values), "mean": sum(values) / len(values)} if values else {}

    return {
        "prompt_len": spread([len(r.prompt) for r in trace]),
        "output_len": spread([r.max_tokens for r in trace]),
    }


def make_trace(
    num: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    max_seq_len: int,
    seed: int,
) -> list[TraceRequest]:
    """``num`` requests with uniform prompt and output lengths (cut so each fits ``max_seq_len``; see
    :func:`check_lengths` and :func:`trace_lengths`)."""
    rng = random.Random(seed)
    trace = []
    for index in range(num):
        out = min(rng.randint(*output_len), max_seq_len - 1)
        length = max(1, min(rng.randint(*prompt_len), max_seq_len - out))
        trace.append(TraceRequest(index, [rng.randrange(vocab) for _ in range(length)], out))
    return trace


async def fetch_model(session: Any, url: str, timeout: float) -> ModelCard:
    """``GET {url}/v1/models`` within ``timeout`` seconds; :class:`ConfigError` (one line) when the server
    does not answer in time, answers with an error, or answers something that is not a model card."""
    import aiohttp

    from devgraph import ConfigError

    what = f"GET {url}/v1/models"
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                detail = _error_message(await response.text())
                raise ConfigError(
                    f"{what} answered HTTP {response.status} ({shorten(detail, 200)}); is --url the base URL "
                    "of a devgraph serve?"
                )
            body = await response.read()
    except asyncio.TimeoutError:
        raise ConfigError(
            f"{what} got no answer within --timeout {timeout:g} s (the server accepted the connection but "
            "did not reply); is it still starting or stuck? Raise --timeout, or check the server"
        ) from None
    except aiohttp.ClientError as exc:
        if isinstance(exc, OSError):  # could not connect: run_from_args says so with the start hint
            raise
        raise ConfigError(f"{what} failed: {type(exc).__name__}: {shorten(str(exc), 200)}") from None
    try:
        return parse_model_card(json.loads(body))
    except (ValueError, RecursionError) as exc:  # not JSON (JSONDecodeError, bad UTF-8), or not a card
        raise ConfigError(
            f"{what} did not answer with devgraph serve's model card: {shorten(str(exc), 200)}; is --url "
            "the base URL of a devgraph serve?"
        ) from None


async def _one(
    session: Any,
    url: str,
    model: str,
    request: TraceRequest,
    temperature: float,
    seed: int,
    timeout: float,
    run_start: float,
) -> RequestResult:
    import aiohttp

    result = RequestResult(request.index, len(request.prompt), request.max_tokens)
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": temperature,
        "seed": seed + request.index,
        "stream": True,
        # The trace sets every output's length: a model's end-of-sequence token does not cut it short.
        "ignore_eos": True,
    }
    start = time.perf_counter()
    result.sent_at = start - run_start
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            if response.status != 200:
                result.error_kind = f"HTTP {response.status}"
                result.error = f"HTTP {response.status}: {_error_message(await response.text())}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error_kind, result.error = "stream error", str(event["error"].get("message"))
                    return result
                choice = event["choices"][0]
                _record(result, choice["token_ids"], time.perf_counter() - start)
                if choice["finish_reason"] is not None:
                    result.finish_reason = choice["finish_reason"]
        result.ok = result.finish_reason is not None
        if not result.ok:
            result.error_kind, result.error = "no finish_reason", "the stream ended without a finish_reason"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        kind = "timeout" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
        result.error_kind, result.error = kind, f"{kind}: {exc}"
    return result


def _error_message(text: str) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body's start."""
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:200]


def _record(result: RequestResult, token_ids: list[int], elapsed: float) -> None:
    if not token_ids:
        return
    if result.ttft is None:
        result.ttft = elapsed
    elif result.token_times:
        gap = (elapsed - result.token_times[-1]) / len(token_ids)
        result.itl += [gap] * len(token_ids)
    result.token_times += [elapsed] * len(token_ids)
    result.token_ids += token_ids


async def run_load(
    url: str,
    trace: list[TraceRequest],
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    timeout: float = 600.0,
    progress: bool = True,
    model: str | None = None,
) -> dict[str, Any]:
    """Send ``trace`` with fixed ``concurrency`` (default 8) or Poisson ``request_rate``; the summary and
    the per-request results (``results``, in trace order)."""
    import aiohttp
    from tqdm import tqdm  # type: ignore[import-untyped]

    url = url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0)
    # Every request gives up after `timeout` seconds, including any the session makes without its own.
    session_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=session_timeout) as session:
        model = model or (await fetch_model(session, url, timeout)).id
        bar = tqdm(total=len(trace), desc="requests", unit="req", disable=not progress, file=sys.stderr)
        results: list[RequestResult | None] = [None] * len(trace)

        async def send(request: TraceRequest) -> None:
            results[request.index] = await _one(
                session, url, model, request, temperature, seed, timeout, start
            )
            bar.update(1)

        start = time.perf_counter()
        if request_rate is not None:
            arrivals = random.Random(seed + 1)
            tasks, at = [], 0.0
            for request in trace:
                delay = at - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(send(request)))
                at += arrivals.expovariate(request_rate)
            await asyncio.gather(*tasks)
        else:
            pending = iter(trace)

            async def worker() -> None:
                for request in pending:
                    await send(request)

            await asyncio.gather(*(worker() for _ in range(concurrency or 8)))
        wall = time.perf_counter() - start
        bar.close()
    rows = [asdict(r) for r in results if r is not None]
    # Throughput's wall time: first send to the last token (the trailing [DONE] and closes are not load).
    ends = [r["sent_at"] + r["token_times"][-1] for r in rows if r["token_times"]]
    summary = summarize(rows, max(ends) if ends else wall)
    return {"summary": summary, "results": rows, "model": model}


def _command_line() -> str:
    """How this process was started, as a shell line (``python -m devgraph.serve`` for the module)."""
    program = os.path.basename(sys.argv[0])
    head = ["python", "-m", "devgraph.serve"] if program == "__main__.py" else [program]
    return shlex.join([*head, *sys.argv[1:]])


async def wait_for_graphs(session: Any, url: str, timeout: float, say: Callable[[str], None]) -> float:
    """Wait until the server's ``/health`` says every graph is captured (a server captures them between
    steps by default: a load sent before would time eager steps); seconds waited. ``say`` gets one line
    when there is something to wait for and one per change of the count. :class:`ConfigError` when the
    capture failed or took longer than ``timeout`` seconds."""
    from devgraph import ConfigError

    start = time.monotonic()
    said = None
    while True:
        async with session.get(f"{url}/health") as response:
            body = await response.json(content_type=None) if response.status == 200 else {}
        graphs = body.get("graphs") if isinstance(body, dict) else None
        if not isinstance(graphs, dict) or graphs.get("ready"):
            return time.monotonic() - start
        if graphs.get("error"):
            raise ConfigError(
                f"the server's graph capture failed ({shorten(str(graphs['error']), 200)}): it serves "
                "eagerly, so a load now measures eager steps; fix the server, or give --no-wait-for-graphs"
            )
        progress = (graphs.get("captured"), graphs.get("total"))
        if progress != said:
            say(f"waiting for the server's graphs: {progress[0]}/{progress[1]} captured")
            said = progress
        if time.monotonic() - start > timeout:
            raise ConfigError(
                f"the server's graphs were not all captured within --timeout {timeout:g} s ({progress[0]}/"
                f"{progress[1]}); raise --timeout, or give --no-wait-for-graphs to measure the steps as they "
                "are"
            )
        await asyncio.sleep(0.1)


def run_from_args(args: argparse.Namespace) -> int:
    from devgraph import ConfigError

    if args.json:
        _check_writable(args.json)
    lengths: dict[str, Any] = {}
    waited: dict[str, float] = {}

    async def main() -> dict[str, Any]:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
            card = await fetch_model(session, args.url.rstrip("/"), args.timeout)
            if not getattr(args, "no_wait_for_graphs", False):
                waited["graphs_s"] = await wait_for_graphs(
                    session,
                    args.url.rstrip("/"),
                    args.timeout,
                    lambda line: print(f"devgraph bench serve: {line}", file=sys.stderr, flush=True),
                )
        warning = check_lengths(args.prompt_len, args.output_len, card.max_seq_len)
        if warning:
            print(f"devgraph bench serve: warning: {warning}", file=sys.stderr, flush=True)
        trace = make_trace(
            args.num_requests,
            args.prompt_len,
            args.output_len,
            card.vocab_size,
            card.max_seq_len,
            args.seed,
        )
        lengths.update(trace_lengths(trace), context=card.max_seq_len, cut=warning is not None)
        return await run_load(
            args.url,
            trace,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            temperature=args.temperature,
            seed=args.seed,
            timeout=args.timeout,
            progress=not args.no_progress,
            model=card.id,
        )

    try:
        run = asyncio.run(main())
    except OSError as exc:
        raise ConfigError(
            f"cannot reach the server at {args.url}: {exc}; start it with devgraph serve"
        ) from None
    _print(summary_table(run["summary"]))
    _print(_sent(lengths))
    if args.json:
        record = {
            "command": _command_line(),
            "label": args.label,
            "url": args.url,
            "load": {"concurrency": args.concurrency, "request_rate": args.request_rate},
            "sent": lengths,
            "waited_for_graphs_s": waited.get("graphs_s"),  # None: --no-wait-for-graphs
            **run,
        }
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0 if run["summary"]["failed"] == 0 else 1


def _sent(lengths: dict[str, Any]) -> str:
    prompt, output = lengths.get("prompt_len") or {}, lengths.get("output_len") or {}
    if not prompt:
        return "sent no requests"
    cut = f" (cut to the context of {lengths['context']})" if lengths.get("cut") else ""
    return (
        f"sent prompts of {prompt['min']}-{prompt['max']} tokens (mean {prompt['mean']:.1f}), "
        f"max_tokens {output['min']}-{output['max']} (mean {output['mean']:.1f}){cut}"
    )


def _check_writable(path: str) -> None:
    """:class:`ConfigError` now, not after the run, when ``--json PATH`` cannot be written."""
    from devgraph import ConfigError

    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"--json {shorten(path)} cannot be written: {exc.strerror}") from None
    if not existed:
        os.remove(path)


def _print(text: str) -> None:
    """Print to stdout; a reader that went away (``| head``) ends the output quietly, not with a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not fail again at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
