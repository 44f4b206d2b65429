"""The ``devgraph`` command: ``info`` (what is installed and usable here), ``demo``, ``tune`` (capture sizes
from recorded steps), ``serve`` and ``bench``.

Every error is one line in argparse's style, prefixed by the command that failed
(``devgraph demo: error: ...``, ``devgraph serve: error: ...``; ``devgraph: error: ...`` before a command
is known), exit code 2. Bad arguments are found before anything runs: argparse ``type=`` checks the form
of each value, :func:`check_demo_args` what needs the machine (is the device usable here, is the
``--json`` path writable). A bare ``devgraph`` (or ``devgraph bench``) prints its help and the commands
to stderr and exits 2, like any argparse program missing a required argument.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from devgraph import (
    BackendUnavailableError,
    ConfigError,
    DevGraphError,
    DeviceGraphConfig,
    __version__,
    resolve_platform,
)
from devgraph.console import OneLineParser, missing_command, parse_command_line, run_command
from devgraph.flag.config import device_graph_mode_type
from devgraph.flag.factory import usable_platform
from devgraph.flag.sizes import check_size_list
from devgraph.messages import shorten

__all__ = ["build_parser", "check_demo_args", "main"]

MAX_SEED = (1 << 63) - 1
MAX_ITERS = 100_000


def _int_in(text: str, low: int, high: int) -> int:
    value = text.strip()
    if len(value) > 24:  # int() of thousands of digits is slow and then refused anyway
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not an integer from {low} to {high}")
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not an integer from {low} to {high}") from None
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"{number} is out of range; accepted: {low} to {high}")
    return number


def _iters(text: str) -> int:
    return _int_in(text, 1, MAX_ITERS)


def _seed(text: str) -> int:
    return _int_in(text, 0, MAX_SEED)


def _sizes(phase: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        parts = [s.strip() for s in text.split(",") if s.strip()]
        if not parts or any(len(p) > 24 or not p.lstrip("-").isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"{shorten(text)} is not a comma-separated list of integers")
        try:
            return check_size_list(phase, [int(p) for p in parts], f"{phase} sizes")
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _device(text: str) -> str:
    """The device's form: ``torch.device`` accepts it, or its type is a registered platform's (``npu``
    before torch-npu is installed; :func:`check_demo_args` then says what to install)."""
    try:
        torch.device(text)
        return text
    except (RuntimeError, ValueError):
        pass
    try:
        resolve_platform(text)
    except BackendUnavailableError:
        return text
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _tp(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a tensor-parallel size from 1 to 64")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="devgraph", description="Device-graph capture and replay for PyTorch engines")
    parser.add_argument("--version", action="version", version=f"devgraph {__version__}")
    parser.set_defaults(command_parser=parser)
    # Not required=True: a bare `devgraph` gets the help and the list of commands, not only an error line.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    info = sub.add_parser("info", help="platforms, plug-ins and backends, and what is usable here")
    info.set_defaults(command_parser=info)
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    demo = sub.add_parser("demo", help="run the reference model eagerly and through graphs; print a table")
    demo.set_defaults(command_parser=demo)
    demo.add_argument(
        "--device-graph-mode",
        type=device_graph_mode_type,
        default="auto",
        metavar="MODE",
        help="auto | disabled | decode=full,prefill=breakable | JSON (see docs/flag.md)",
    )
    demo.add_argument(
        "--device", type=_device, default=None, help="torch device (default: the best device present)"
    )
    demo.add_argument(
        "--preset", default=None, help="reference model preset (default: tiny on CPU, qwen3-0.6b on a GPU)"
    )
    demo.add_argument(
        "--decode-sizes",
        type=_sizes("decode"),
        default=None,
        metavar="N,N,..",
        help="decode batch sizes to capture (default: 1,2,4,8,16)",
    )
    demo.add_argument(
        "--prefill-sizes",
        type=_sizes("prefill"),
        default=None,
        metavar="N,N,..",
        help="prefill token counts to capture (default: 16,32,64,128)",
    )
    demo.add_argument(
        "--iters",
        type=_iters,
        default=None,
        help=f"timed repetitions per size, 1 to {MAX_ITERS} (median reported)",
    )
    demo.add_argument("--seed", type=_seed, default=0, help=f"random seed, 0 to {MAX_SEED}")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    demo.add_argument(
        "--attention",
        choices=("paged", "sdpa"),
        default=None,
        help="reference attention: paged (device metadata, capturable whole; default) or sdpa (a break op)",
    )
    demo.add_argument(
        "--tp",
        type=_tp,
        default=None,
        metavar="N",
        help="tensor-parallel ranks (launch with torchrun --nproc-per-node N -m devgraph demo --tp N)",
    )
    from devgraph.cli.tune import add_tune_command
    from devgraph.serve.cli import add_serve_commands  # the serving application, reached only here

    add_tune_command(sub)
    add_serve_commands(sub)
    return parser


def _check_writable(path: str) -> None:
    """``--json PATH`` must be writable before the demo spends minutes on the run."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--json {shorten(path)} is a directory; give a file path")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"--json {shorten(path)}: directory {shorten(str(parent))} does not exist")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not writable:
        raise ConfigError(f"--json {shorten(path)} is not writable here; choose another path")


def _check_range(name: str, value: object, low: int, high: int) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high
    ):
        raise ConfigError(f"--{name} must be an integer from {low} to {high}, got {shorten(value)}")


def check_demo_args(args: argparse.Namespace) -> None:
    """Check ``devgraph demo``'s arguments before anything runs; raises a :class:`DevGraphError` naming the
    argument, what is wrong and what is accepted (the device's unusable reason is the one ``devgraph info``
    gives). ``main`` turns it into a usage error; ``run_demo`` may call it again for namespaces built in code.
    """
    DeviceGraphConfig.parse(getattr(args, "device_graph_mode", None))
    usable_platform(getattr(args, "device", None))
    _check_range("iters", getattr(args, "iters", None), 1, MAX_ITERS)
    _check_range("seed", getattr(args, "seed", 0), 0, MAX_SEED)
    for phase in ("decode", "prefill"):
        sizes = getattr(args, f"{phase}_sizes", None)
        if sizes is not None:
            check_size_list(phase, sizes, f"--{phase}-sizes")
    if getattr(args, "json", None):
        _check_writable(args.json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    if args.command is None:
        return missing_command(parser, "info, demo, tune, serve or bench")
    if args.command == "bench" and args.bench is None:
        return missing_command(args.command_parser, "serve")
    return run_command(args.command_parser.prog, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    if args.command == "info":
        from devgraph.cli.info import run_info

        return run_info(as_json=args.json)
    if args.command in ("tune", "serve", "bench"):
        return int(args.run(args))
    try:
        check_demo_args(args)
    except DevGraphError as exc:
        args.command_parser.error(str(exc))
    if args.tp is not None:
        from devgraph.cli.tp_demo import run_tp_demo

        return run_tp_demo(args)
    from devgraph.cli.demo import run_demo

    return run_demo(args)


if __name__ == "__main__":
    raise SystemExit(main())
