"""Exception types raised by devgraph.

Every error devgraph raises on purpose derives from :class:`DevGraphError`, and its
message says what went wrong and what to do next.
"""

from __future__ import annotations

__all__ = [
    "DevGraphError",
    "ConfigError",
    "RegistrationError",
    "BackendUnavailableError",
    "CaptureError",
    "ReplayError",
    "InputError",
    "RecompileError",
]


class DevGraphError(Exception):
    """Base class of every devgraph error."""


class ConfigError(DevGraphError, ValueError):
    """A ``--device-graph-mode`` value, size list or runner argument is invalid."""


class RegistrationError(DevGraphError):
    """A backend or platform registration conflicts with another or is malformed."""


class BackendUnavailableError(DevGraphError):
    """No usable backend exists for the requested (device, phase, mode)."""


class CaptureError(DevGraphError):
    """Capturing a device graph failed.

    ``size`` is the shape key that failed (``None`` when the failure is not tied to one),
    ``op`` the operator that broke the capture rules when known.
    """

    def __init__(self, message: str, *, size: int | None = None, op: str | None = None) -> None:
        super().__init__(message)
        self.size = size
        self.op = op


class ReplayError(DevGraphError):
    """Replaying a captured graph failed or was asked for a shape that was never captured."""


class InputError(DevGraphError, ValueError):
    """An input handed to :meth:`GraphRunner.run` does not fit its static buffer."""


class RecompileError(DevGraphError):
    """``torch.compile`` recompiled after capture, which would silently bypass the graphs."""
