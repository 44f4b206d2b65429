"""Arguments and entry points of ``devgraph serve`` and ``devgraph bench serve``.

The ``devgraph`` command (:mod:`devgraph.cli`) adds both with :func:`add_serve_commands`;
``python -m devgraph.serve`` runs the same commands through :func:`serve_main`, with the same parser and
the same one-line errors (:mod:`devgraph.console`). The heavy imports (torch models, aiohttp) happen in the
``run_*`` functions, not at parse time; both first check that the ``serve`` extra is installed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from devgraph import add_device_graph_args, apply_tuned
from devgraph.console import OneLineParser, parse_command_line, run_command
from devgraph.extras import require_extra
from devgraph.messages import shorten
from devgraph.reference.config import ATTENTION_MODES, PRESET_NAMES
from devgraph.serve.checkpoint.template_render import RenderLimits
from devgraph.serve.engine.config import OutputDelivery

__all__ = [
    "add_bench_serve_parser",
    "add_serve_commands",
    "add_serve_parser",
    "run_bench_serve",
    "run_serve",
    "serve_main",
]

_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
#: The slowest Poisson arrival rate ``bench serve`` accepts (requests per second).
MIN_REQUEST_RATE = 0.01


def _int_in(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        value = text.strip()
        if len(value) > 24 or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{shorten(text)} is not an integer from {low} to {high}")
        number = int(value)
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is out of range; accepted: {low} to {high}")
        return number

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{shorten(text)} must be a finite number > 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a number of seconds") from None
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{shorten(text)} must be a finite number of seconds >= 0")
    return value


def _request_rate(text: str) -> float:
    value = _positive_float(text)
    if value < MIN_REQUEST_RATE:
        raise argparse.ArgumentTypeError(
            f"{shorten(text)} requests/s is below the minimum of {MIN_REQUEST_RATE:g} (one request every "
            f"{1 / MIN_REQUEST_RATE:g} s on average); use --concurrency 1 for a slow trickle"
        )
    return value


def _url(text: str) -> str:
    """A server's base URL: ``http(s)://host[:port]``, no path beyond ``/``."""
    from urllib.parse import urlsplit

    hint = "give the server's base URL, such as http://127.0.0.1:8000"
    try:
        parts = urlsplit(text.strip())
        port = parts.port  # a bad port raises ValueError here
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a URL ({exc}); {hint}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not an http:// or https:// URL; {hint}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(
            f"{shorten(text)} has a path or query; {hint} (the routes, /v1/completions and /v1/models, "
            "are added to it)"
        )
    return text.strip().rstrip("/")


def _range(text: str) -> tuple[int, int]:
    """``A:B`` (uniform from A to B inclusive) or ``N`` (always N)."""
    low, _, high = text.partition(":")
    parse = _int_in(1, 1 << 20)
    first = parse(low)
    second = parse(high) if high else first
    if second < first:
        raise argparse.ArgumentTypeError(f"{shorten(text)}: the range's end is below its start")
    return first, second


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``devgraph serve``: an OpenAI-style completions server over the reference engine."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over the OpenAI API (completions, chat) with continuous batching and graphs",
        description=_SERVE_DESCRIPTION,
    )
    return _serve_args(parser)


_SERVE_DESCRIPTION = (
    "Serve a Hugging Face checkpoint (or a random-weight preset) on the reference model and engine over the "
    "OpenAI API; see docs/serving.md."
)
_BENCH_DESCRIPTION = "Send a seeded request trace to a running server; report TTFT, ITL and throughput."


def _serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_device_graph_args(parser)
    parser.add_argument(
        "--tuned",
        default=None,
        metavar="PATH",
        help="capture sizes from devgraph tune --out, put into --device-graph-mode (docs/user-guide.md)",
    )
    parser.add_argument(
        "--record-steps",
        default=None,
        metavar="PATH",
        help="record the traffic's steps for devgraph tune: a trace written to PATH every --record-interval "
        "seconds and at shutdown (docs/serving.md)",
    )
    parser.add_argument(
        "--record-interval",
        type=_positive_float,
        default=60.0,
        metavar="SECONDS",
        help="seconds between two writes of --record-steps (default 60)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR|PRESET",
        help="a local Hugging Face checkpoint directory (Llama, Qwen2, Qwen3, Mistral; safetensors) or a "
        f"random-weight preset ({', '.join(PRESET_NAMES)}; default: tiny on CPU, qwen3-0.6b on a GPU)",
    )
    parser.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default=None,
        help="a random-weight preset (the same as --model NAME)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template replacing the checkpoint's own (for /v1/chat/completions)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates sent in requests (chat_template, chat_template_kwargs.chat_template); "
        "off by default: a template is code, and only the server's own is rendered",
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=_positive_float,
        default=RenderLimits.seconds,
        metavar="SECONDS",
        help="seconds one chat-template render may take before its worker process is stopped and the "
        f"request gets 400 (default {RenderLimits.seconds:g})",
    )
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="model dtype (default: the checkpoint's or the preset's)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: the best device present)")
    parser.add_argument(
        "--tp",
        type=_int_in(1, 64),
        default=1,
        help="tensor-parallel ranks: the server spawns N-1 worker processes (cuda:0..N-1, NCCL; or CPU "
        "processes over gloo); a lost rank stops the server (docs/tensor-parallel.md)",
    )
    parser.add_argument("--attention", choices=ATTENTION_MODES, default=None, help="paged (default) or sdpa")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=_int_in(0, 65535), default=8000, help="port; 0 picks a free one (printed)"
    )
    parser.add_argument(
        "--max-running-requests",
        type=_int_in(1, 4096),
        default=None,
        help="batch limit (default 8 CPU, 32 GPU)",
    )
    parser.add_argument(
        "--token-budget",
        type=_int_in(1, 1 << 20),
        default=None,
        help="tokens per step (default 64 CPU, 2048 GPU)",
    )
    parser.add_argument(
        "--num-blocks",
        type=_int_in(2, 1 << 24),
        default=None,
        help="KV blocks (default: enough for every running request at full length)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=_int_in(2, 1 << 20),
        default=None,
        help="context length (default: the preset's; a checkpoint's up to 2048)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="fixed step shapes: a request's tokens do not depend on the batch",
    )
    parser.add_argument(
        "--capture-in-background",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="answer from the moment the weights are loaded: steps run eagerly while the graphs are "
        "captured one key between two steps; /health shows the progress (default: on with one rank and "
        "graphs that do not compile; --no-capture-in-background captures every graph before listening)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=None,
        help="size the KV cache to this share of the device's memory, less what is in use and the graphs' "
        "memory estimated before capture (instead of --num-blocks)",
    )
    parser.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="POST /sleep (level 1: free the graphs and the KV cache of an idle server; the weights stay), "
        "POST /wake_up, GET /is_sleeping; requests while asleep get 503",
    )
    parser.add_argument(
        "--no-mixed-steps", action="store_true", help="run decodes and prefill chunks in separate steps"
    )
    parser.add_argument(
        "--scheduler",
        choices=("overlap", "serial"),
        default="overlap",
        help="overlap (default): schedule and issue the next step while the device runs this one, read "
        "its tokens after; serial: read each step's tokens before scheduling the next (to compare, or "
        "fall back). Steps of requests with a grammar run serially either way",
    )
    parser.add_argument("--seed", type=_int_in(0, (1 << 63) - 1), default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the --model value)"
    )
    parser.add_argument(
        "--log-stats-interval",
        type=_seconds,
        default=10.0,
        help="seconds between INFO lines with throughput and KV-cache usage (default 10; 0: none)",
    )
    parser.add_argument(
        "--max-queued-requests", type=_int_in(1, 1 << 20), default=1024, help="in-flight limit; past it 429"
    )
    parser.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM (default 30)",
    )
    parser.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a request body may take to arrive; a slower client gets 408 (default 30)",
    )
    parser.add_argument(
        "--structured-outputs",
        choices=("all", "json", "none"),
        default="all",
        help="constraints requests may carry: all (default: JSON schemas, tool calls, regexes, choices, "
        "grammars), json (JSON schemas and tool calls), none",
    )
    parser.add_argument(
        "--cpu-threads", type=_int_in(1, 1024), default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument(
        "--switch-interval-us",
        type=_int_in(1, 1_000_000),
        default=None,
        help="Python's thread switch interval, microseconds (sys.setswitchinterval; default: "
        "Python's 5000): how long a thread that wants the interpreter lock waits before the holder "
        "must give it up. The engine thread gives the lock up in every torch call and waits for it "
        "while the HTTP thread streams. Measured (docs/tensor-parallel.md, round 11): at 100, a --tp 2 "
        "server's rank 0 issued its steps 14-28%% faster in one A/B, not across calls; tokens/s stayed "
        "within the runs' spread",
    )
    parser.add_argument(
        "--output-delivery",
        choices=[d.value for d in OutputDelivery],
        default=OutputDelivery.AT_ONCE.value,
        help="when a step's tokens go to the HTTP side under the overlapped scheduler: at-once (default: as "
        "soon as they are read) or next-issue (once the engine has issued the next step, while it waits "
        "for the device: a shorter issue under load, but fewer tokens/s on Qwen3-0.6B at 32 streams "
        "in the one A/B of docs/tensor-parallel.md, round 12)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a capture progress bar (default: when stderr is a terminal; otherwise one log line per graph)",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="info (default) logs each start-up stage; warning shows only problems",
    )
    parser.set_defaults(run=run_serve, command_parser=parser)
    return parser


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``devgraph bench serve``: a load generator against a running ``devgraph serve``."""
    parser = subparsers.add_parser(
        "serve",
        help="load-test a running devgraph serve over HTTP: TTFT, inter-token latency, tokens/s",
        description=_BENCH_DESCRIPTION,
    )
    return _bench_args(parser)


def _bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--url", type=_url, default="http://127.0.0.1:8000", help="the server's base URL (http://host:port)"
    )
    parser.add_argument("--num-requests", type=_int_in(1, 1 << 20), default=64)
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--concurrency", type=_int_in(1, 1 << 16), default=None, help="requests in flight (default 8)"
    )
    group.add_argument(
        "--request-rate",
        type=_request_rate,
        default=None,
        help=f"Poisson arrivals per second (at least {MIN_REQUEST_RATE:g})",
    )
    parser.add_argument(
        "--prompt-len", type=_range, default=(32, 256), metavar="A:B", help="uniform prompt lengths"
    )
    parser.add_argument(
        "--output-len", type=_range, default=(64, 128), metavar="A:B", help="uniform max_tokens"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=_int_in(0, (1 << 63) - 1), default=0, help="trace seed")
    parser.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="write the results (and the command) here"
    )
    parser.add_argument("--label", default=None, help="a name for this run in the JSON (e.g. the mode)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-wait-for-graphs",
        action="store_true",
        help="send the load at once, even while the server still captures its graphs (by default the "
        "benchmark waits until /health says they are ready)",
    )
    parser.set_defaults(run=run_bench_serve, command_parser=parser)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    require_extra("aiohttp", extra="serve", needed_by="this command")  # before minutes of start-up
    from devgraph.serve.api.server import serve

    if getattr(args, "tuned", None):
        args.device_graph_mode = apply_tuned(args.device_graph_mode, args.tuned)
    if getattr(args, "record_steps", None):
        from devgraph.serve.api.recording import check_record_path

        check_record_path(args.record_steps)
    return serve(args)


def run_bench_serve(args: argparse.Namespace) -> int:
    require_extra("aiohttp", extra="serve", needed_by="this command")
    from devgraph.serve.bench.loadgen import run_from_args

    return run_from_args(args)


def add_serve_commands(subparsers: Any) -> None:
    """``serve`` and ``bench serve`` under a parser's ``subparsers`` (the ``devgraph`` command's)."""
    add_serve_parser(subparsers)
    bench = subparsers.add_parser(
        "bench", help="load benchmarks (bench serve: a trace against a running server)"
    )
    bench.set_defaults(command_parser=bench)
    add_bench_serve_parser(
        bench.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=OneLineParser)
    )


def serve_main(argv: Sequence[str]) -> int:
    """``python -m devgraph.serve [arguments]``: ``devgraph serve [arguments]``; ``... bench [arguments]``:
    ``devgraph bench serve [arguments]``."""
    parser = OneLineParser(prog="devgraph")
    add_serve_commands(parser.add_subparsers(dest="command", parser_class=OneLineParser))
    args = parse_command_line(
        parser, ["bench", "serve", *argv[1:]] if argv[:1] == ["bench"] else ["serve", *argv]
    )
    return run_command(args.command_parser.prog, lambda: args.run(args))
