"""Reading a JSON file a user named (a trace, tuned sizes, a checkpoint's config): every way the file can be
wrong is one :class:`ConfigError` naming the file and what is wrong, never a traceback from the decoder.

What is caught: a file that cannot be read (missing, a directory, no permission), one larger than
:data:`MAX_JSON_BYTES` (``/dev/zero`` included), bytes that are not UTF-8, text that is not JSON, JSON nested
deeper than the decoder recurses, and an integer longer than Python converts (4300 digits by default).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from devgraph.errors import ConfigError
from devgraph.messages import shorten

__all__ = ["MAX_JSON_BYTES", "read_json_file"]

#: The largest JSON file read (a trace of a million distinct step counts is about 20 MiB).
MAX_JSON_BYTES = 256 << 20


def read_json_file(path: str | Path, what: str = "JSON") -> Any:
    """The parsed contents of ``path``; ``what`` names the file's role in errors (``"recorded steps"``)."""
    source = Path(path)
    try:
        with source.open("rb") as handle:
            raw = handle.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} from {source}: {exc.strerror or exc}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ConfigError(f"{source} is larger than {MAX_JSON_BYTES >> 20} MiB; it is not {what}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); {what} is JSON"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        problem = f"it is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except RecursionError:
        problem = f"its JSON nests arrays or objects too deeply to read; it is not {what}"
    except ValueError as exc:  # an integer of more digits than int() converts
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        problem = (
            f"it holds an integer of more than {limit} digits"
            if "digits" in str(exc)
            else f"it holds a value JSON cannot be read into: {shorten(str(exc), 120)}"
        )
    raise ConfigError(f"{source}: {problem}")
