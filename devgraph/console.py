"""How devgraph's commands talk on a terminal: every error one line, prefixed by the command that failed
(``devgraph serve: error: ...``), argparse without usage dumps, and one mapping from what went wrong to
an exit code. ``devgraph`` (:mod:`devgraph.cli`) and ``python -m devgraph.serve`` (:mod:`devgraph.serve`)
both run their commands through it. A root leaf: it imports only devgraph's errors."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence

from devgraph.errors import DevGraphError

__all__ = ["OneLineParser", "error_line", "missing_command", "parse_command_line", "run_command"]


def error_line(prog: str, message: object) -> str:
    """The one error style of every command: ``devgraph serve: error: <message on one line>``."""
    return f"{prog}: error: {' '.join(str(message).split())}"


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line, no usage dump: servers' logs and CI output stay readable."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, error_line(self.prog, message) + "\n")


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that arguments no parser knows are reported by the command they
    were given to (``devgraph serve: error: unrecognized arguments: --modle (did you mean --model?)``), not by
    the top-level parser: argparse hands a subcommand's unknown arguments up to ``devgraph: error:``. Each
    parser sets ``command_parser`` to itself in its defaults, so the deepest one parsed is known."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command: argparse.ArgumentParser = getattr(args, "command_parser", None) or parser
        known = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
        guesses = [difflib.get_close_matches(u.split("=", 1)[0], known, n=1) for u in unknown]
        hint = next((f" (did you mean {g[0]}?)" for g in guesses if g), "")
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def missing_command(parser: argparse.ArgumentParser, choices: str) -> int:
    """A bare ``devgraph`` or ``devgraph bench``: the help (the commands and what they do) and an error
    line on stderr, exit code 2 (argparse's code for a missing argument)."""
    parser.print_help(sys.stderr)
    print(error_line(parser.prog, f"a command is required: {choices}"), file=sys.stderr)
    return 2


def run_command(prog: str, command: Callable[[], int]) -> int:
    """Run ``command``; a :class:`DevGraphError` becomes one error line and exit code 2, Ctrl-C exit code
    130, and a reader that went away (``devgraph info | head``) a quiet 0."""
    try:
        return int(command())
    except DevGraphError as exc:
        print(error_line(prog, exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
        os.close(devnull)
        return 0
