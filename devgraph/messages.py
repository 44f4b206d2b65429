"""How devgraph's messages show what they talk about (a value cut to a readable length, a value's kind, an
exception on one line), and the texts several layers and plug-ins share. A root leaf: it imports nothing of
devgraph, so every layer, and every plug-in, may use it."""

from __future__ import annotations

__all__ = [
    "ADVICE_ATTRIBUTE",
    "CAUSE_ATTRIBUTE",
    "HOST_SYNC",
    "HOST_SYNC_ADVICE",
    "capture_oom",
    "describe_error",
    "kind",
    "shorten",
]

#: The cause every platform names when a capture fails on a host sync or a call a graph cannot hold.
HOST_SYNC = "an op synchronized with the host or used a non-capturable API"
#: The attribute a platform sets on an error it recognised (``"out_of_memory"``): the capture advice then
#: follows that cause, whatever the error's own text says.
CAUSE_ATTRIBUTE = "devgraph_cause"
#: Beside it, the advice for a cause the capture advice does not know (what the sanitizer found).
ADVICE_ATTRIBUTE = "devgraph_advice"


def capture_oom(error: BaseException, failures: int) -> str:
    """What a capture that ran out of memory says, when the device reported something else after the
    allocator failed (torch turns an out-of-memory during capture into an invalidated capture)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"the device ran out of memory during capture ({failures} failed allocation(s) while capturing; "
        f"the device then reported: {first[:200]})"
    )


#: What to do about it; the capture advice and each platform's translated error add what is their own.
HOST_SYNC_ADVICE = (
    "remove host reads (.item(), .tolist(), .cpu(), bool(tensor), printing) and data-dependent shapes "
    "(nonzero, boolean-mask indexing) from the captured forward, or make that op a @devgraph.graph_break op"
)


def shorten(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that echo user input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 14]}... ({len(text)} chars)"


def kind(value: object) -> str:
    """``"a boolean"``, ``"an int"``, ``"a float"``: the type of a bad value, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def describe_error(exc: BaseException, limit: int = 200) -> str:
    """``"RuntimeError: message"`` on one line, the message cut to ``limit`` characters (a plug-in's
    exception text is not ours to print whole)."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = f"{text[: limit - 3]}..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
