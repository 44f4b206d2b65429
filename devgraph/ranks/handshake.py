"""The ranks' handshake around ``capture()``: same keys in the same order, in step, and a failure on any
rank raised on every rank (over the control group, within the rank timeout)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from devgraph.contract.keys import GraphKey
from devgraph.contract.platform import GraphPlatform
from devgraph.errors import CaptureError
from devgraph.messages import describe_error, shorten
from devgraph.ranks.group import (
    RANK_TIMEOUT_ENV,
    PeerLost,
    barrier,
    exchange,
    is_multi_rank,
    rank_name,
    rank_of,
    rank_timeout_s,
    settle_device,
)

__all__ = ["CaptureSync"]

_STAGES = {"ready": "start", "barrier": "end of the warm-ups", "agree": "capture"}


class CaptureSync:
    """The handshake of one ``capture()`` (or one lazily captured key) across the ranks of ``group``.

    The capture loop calls, per key: :meth:`ready` before the warm-ups, :meth:`barrier` after them, and
    :meth:`agree` after the capture (with this rank's exception, if any). Each is one exchange on the
    control group carrying a digest of what this rank is about to capture (its key list, the graph set's
    backend, the static buffers' names, dtypes and shapes), so ranks about to capture different graphs
    stop at the first ``ready``, before any warm-up runs collectives of different shapes. A rank that
    fails before or during its warm-ups skips its later handshakes and goes straight to :meth:`agree`,
    which meets the others' ``ready`` or ``barrier``: every rank makes the same number of exchanges before
    it stops, and all of them raise. The handshakes come before the device barrier, so a rank learns of a
    lost peer instead of blocking in ``synchronize()`` on a collective that peer will never join (work
    already queued so is dealt with by :func:`~devgraph.ranks.settle_device`, after this rank's graphs
    are released). With one rank, or none, only the device barrier is left.
    """

    def __init__(
        self,
        platform: GraphPlatform,
        group: Any,
        phase: str,
        keys: Sequence[GraphKey],
        backend: Any = None,
        buffers: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.platform = platform
        self.group = group
        self.phase = phase
        self.backend = backend
        self.multi = is_multi_rank(group)
        texts = [str(k) for k in keys]
        setup = _setup(backend, buffers)
        self._digest = hashlib.blake2b("\n".join([*texts, *setup]).encode(), digest_size=8).hexdigest()
        self._listing = shorten(texts, 160) + (f" with {', '.join(setup)}" if setup else "")
        self._key: GraphKey | None = None
        self._raised: CaptureError | None = None  # the handshake error this rank raised, if any

    def ready(self, key: GraphKey) -> None:
        """Before ``key``'s warm-ups."""
        self._key = key
        if self.multi:
            self._handshake("ready", key, None)

    def barrier(self) -> None:
        """After the last warm-up of the current key, before its capture."""
        if self.multi and self._key is not None:
            self._handshake("barrier", self._key, None)
        barrier(self.platform, self.group)

    def agree(self, key: GraphKey, error: BaseException | None) -> None:
        """After ``key``'s capture on this rank (``error``: why it failed here): raise if any rank failed."""
        if self._raised is not None:  # a handshake of this key raised already: the others have stopped
            raise self._raised
        if self.multi:
            self._handshake("agree", key, error)

    def _handshake(self, stage: str, key: GraphKey, error: BaseException | None) -> None:
        group = self.group
        me = rank_name(group, rank_of(group))
        mine = None if error is None else _failure_text(error)
        try:
            answers = exchange(group, (self._digest, self._listing, stage, str(key), mine))
        except PeerLost as exc:
            note = self._settle()
            raise self._fail(
                f"{me} waited for the other ranks at the {_STAGES[stage]} of the {self.phase} graph for "
                f"{key}, and one of them died or did not answer within {rank_timeout_s():g} s ({exc}).{note}"
                f" Set {RANK_TIMEOUT_ENV} to wait longer; every rank stops capturing",
                key,
            ) from (error or exc)
        if any(answer[0] != self._digest for answer in answers):
            shown = "; ".join(f"{rank_name(group, r)}: {answer[1]}" for r, answer in enumerate(answers))
            raise self._fail(
                f"the ranks are about to capture different {self.phase} keys, graph sets or buffers "
                f"({shown}); build every rank's runner with the same sizes, axes, variants, mode and inputs",
                key,
            ) from error
        failed = [(r, answer) for r, answer in enumerate(answers) if answer[4] is not None]
        if failed:
            note = self._settle()
            shown = "; ".join(
                f"on {rank_name(group, r)}"
                + (f" (at {answer[3]})" if answer[3] != str(key) else "")
                + f": {answer[4]}"
                for r, answer in failed
            )
            raise self._fail(
                f"capturing the {self.phase} graph for {key} failed {shown}.{note} Every rank stops "
                f"capturing (this is {me})",
                key,
            ) from error

    def _settle(self) -> str:
        return settle_device(self.platform, self.group, release=self._release_graphs)

    def _release_graphs(self) -> None:
        """Free this rank's graphs while their communicator still exists (NCCL waits for graphs that hold
        its collectives before it lets a communicator go, even when aborting it)."""
        backend = self.backend
        if backend is not None and getattr(backend, "supports_release", False):
            for key in backend.captured_keys():
                backend.release(key)

    def _fail(self, message: str, key: GraphKey) -> CaptureError:
        error = CaptureError(message, size=key.tokens)
        error.key = key  # type: ignore[attr-defined]
        self._raised = error
        return error


def _setup(backend: Any, buffers: Mapping[str, torch.Tensor] | None) -> list[str]:
    """What besides the keys the ranks must share: the graph set's backend and the static buffers."""
    found = [f"backend {backend.name}"] if getattr(backend, "name", None) else []
    for name, buffer in sorted((buffers or {}).items()):
        found.append(f"{name} {list(buffer.shape)} {str(buffer.dtype).removeprefix('torch.')}")
    return found


def _failure_text(error: BaseException) -> str:
    """A failed rank's error for the others' messages: a CaptureError's own text (it names the key and
    what to do), anything else as ``Type: text``; without a trailing period."""
    text = " ".join(str(error).split()) if isinstance(error, CaptureError) else describe_error(error, 600)
    return text[:800].rstrip(". ")
