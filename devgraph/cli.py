"""The ``devgraph`` command: ``info`` (what is installed and usable here) and ``demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from devgraph.errors import DevGraphError

__all__ = ["main", "build_parser"]


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line, no usage dump: servers' logs and CI output stay readable."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive integers")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="devgraph", description="Device-graph capture and replay for PyTorch engines"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    info = sub.add_parser("info", help="platforms, plug-ins and backends, and what is usable here")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    demo = sub.add_parser("demo", help="run the reference model eagerly and through graphs; print a table")
    demo.add_argument(
        "--device-graph-mode",
        default="auto",
        metavar="MODE",
        help="auto | disabled | decode=full,prefill=breakable | JSON (see docs/flag.md)",
    )
    demo.add_argument("--device", default=None, help="torch device (default: the best device present)")
    demo.add_argument(
        "--preset", default=None, help="reference model preset (default: tiny on CPU, qwen3-0.6b on a GPU)"
    )
    demo.add_argument(
        "--decode-sizes",
        type=_sizes,
        default=None,
        metavar="N,N,..",
        help="decode batch sizes to capture (default: 1,2,4,8,16)",
    )
    demo.add_argument(
        "--prefill-sizes",
        type=_sizes,
        default=None,
        metavar="N,N,..",
        help="prefill token counts to capture (default: 16,32,64,128)",
    )
    demo.add_argument("--iters", type=int, default=None, help="timed repetitions per size (median reported)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            from devgraph._info import run_info

            return run_info(as_json=args.json)
        from devgraph._demo import run_demo

        return run_demo(args)
    except DevGraphError as exc:
        print(f"devgraph: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("devgraph: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
