"""Stop strings: finding them in generated text as it streams, and cutting the text there.

Text arrives in pieces (one per engine step). A stop string may span pieces, so the end of the text that
could still grow into a stop string is held back until it cannot; everything before it is released.
When a stop string appears, the text is cut at its start (or after it, with
``include_stop_str_in_output``) and the request ends with ``finish_reason: "stop"``. The earliest match
wins when several stop strings appear in one piece.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feed text pieces; get back what may be shown and whether a stop string was reached."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = tuple(stops)
        self.include = include
        self.stopped = False
        self._held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, piece: str) -> str:
        """The text that can be released after ``piece``; nothing more once a stop string was found."""
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.stopped = True
            self._held = ""
            return text[: start + len(stop)] if self.include else text[:start]
        keep = self._held_back(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Text held back when generation ended without reaching a stop string."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        found = [(text.find(stop), stop) for stop in self.stops]
        hits = [(index, stop) for index, stop in found if index >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        for length in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
