"""The chat-template worker: a process of its own that renders chat templates for ``devgraph serve``.

Run as a script by :mod:`devgraph.serve.checkpoint.template_render` (never imported: it needs only jinja2 and
transformers' renderer, not torch or devgraph). A template is code, and one from a request is an
adversary's code: here it runs bounded, and the server can always kill the process. Each render has

* a wall-clock budget: an interval timer interrupts the render (Python-level loops of the template);
* a CPU budget: ``RLIMIT_CPU`` set just past it, so a single C-level operation that ignores the timer
  still ends the process (the kernel's ``SIGXCPU``), even if the server is gone;
* a memory ceiling: ``RLIMIT_AS`` a fixed headroom above what the process holds once started, so
  ``'x' * 10**12`` is a ``MemoryError``, not the machine's memory;
* an output limit in characters.

The server kills the process at its own deadline (a little past the budget) whatever happens here.

Protocol: frames on stdin / stdout, each a 4-byte big-endian length and UTF-8 JSON. The worker says
``{"ready": true}`` once its imports are done, then answers each request
``{"template", "messages", "variables", "add_generation_prompt", "continue_final_message", "tools"}`` with
``{"text": ...}`` or ``{"error": kind, "message": ...}`` (kind: ``template``, ``time``, ``size``,
``memory``). End of stdin ends it.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")


class _OutOfTime(BaseException):  # BaseException: a template's caller catching Exception cannot swallow it
    pass


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    return json.loads(stream.read(size).decode("utf-8"))


def _send(stream: BinaryIO, message: Any) -> None:
    body = json.dumps(message).encode("ascii")  # non-ASCII (lone surrogates too) as \u escapes
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def _address_space() -> int | None:
    """Bytes of virtual memory this process maps now (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _limit_memory(headroom: int) -> None:
    try:
        import resource
    except ImportError:  # not a POSIX system: the server's deadline still bounds the render
        return
    mapped = _address_space()
    if mapped is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + headroom
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard < 0 else min(limit, hard), hard))


def _limit_cpu(seconds: float) -> None:
    """The process may use ``seconds`` more CPU seconds from now; past that the kernel ends it."""
    try:
        import resource
    except ImportError:
        return
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(spent + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))


def _render(request: dict[str, Any], render: Any, seconds: float, max_chars: int) -> dict[str, Any]:
    def out_of_time(signum: int, frame: Any) -> None:
        raise _OutOfTime

    signal.signal(signal.SIGALRM, out_of_time)
    _limit_cpu(seconds + 1)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        rendered, _ = render(
            conversations=[request["messages"]],
            chat_template=request["template"],
            continue_final_message=request["continue_final_message"],
            add_generation_prompt=request["add_generation_prompt"],
            tools=request.get("tools"),
            **request["variables"],
        )
    except _OutOfTime:
        return {"error": "time", "message": f"it did not finish within {seconds:g} s"}
    except MemoryError:
        return {"error": "memory", "message": "it needed more memory than a render may take"}
    except RecursionError:
        return {"error": "template", "message": "it recursed too deeply"}
    except Exception as exc:  # the template's raise_exception(...), syntax errors, its own bugs
        return {"error": "template", "message": " ".join(f"{type(exc).__name__}: {exc}".split())[:400]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    text = rendered[0]
    if len(text) > max_chars:
        return {"error": "size", "message": f"it wrote {len(text)} characters, more than {max_chars}"}
    return {"text": text}


def main() -> int:
    seconds, max_chars, headroom = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which ends this process
    # Frames go out on a private copy of stdout; anything a library prints goes to stderr instead.
    frames_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    frames_in = sys.stdin.buffer
    from transformers.utils.chat_template_utils import render_jinja_template

    # One render before the limits, so what it imports lazily is counted in the baseline, not the headroom.
    render_jinja_template(conversations=[[{"role": "user", "content": "hi"}]], chat_template="{{ 1 }}")
    _limit_memory(headroom)
    _send(frames_out, {"ready": True})
    while True:
        request = _receive(frames_in)
        if request is None:
            return 0
        reply = _render(request, render_jinja_template, seconds, max_chars)
        _send(frames_out, reply)
        if reply.get("error") == "memory":  # the heap may be left fragmented near the ceiling: start afresh
            return 0


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder holds devgraph modules whose names could shadow top-level ones
    raise SystemExit(main())
