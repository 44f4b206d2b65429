"""The serving engine's knobs."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

from devgraph import ConfigError

__all__ = ["EngineConfig", "OutputDelivery", "SchedulerMode"]

_Choice = TypeVar("_Choice", bound="_FlagChoice")


class _FlagChoice(str, enum.Enum):
    """A closed set of names one engine setting takes: printed as its value, parsed with an error that
    lists the choices (:meth:`setting` names the setting in it)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def setting(cls) -> str:
        raise NotImplementedError

    @classmethod
    def parse(cls: type[_Choice], value: object) -> _Choice:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(f"{cls.setting()} must be one of {choices}, got {value!r}") from None


class SchedulerMode(_FlagChoice):
    """How the engine's host work meets the device's (``--scheduler``).

    ``overlap``: step N+1 is scheduled, staged and issued while the device runs step N, and step N's
    tokens are read (stop checks, outputs) after that; its input ids come from step N's sampled tokens on
    the device. ``serial``: each step's tokens are read before the next step is scheduled (the device
    waits for the host between steps). Both give every request the same tokens for the same logits.
    """

    SERIAL = "serial"
    OVERLAP = "overlap"

    @classmethod
    def setting(cls) -> str:
        return "scheduler"

    @property
    def overlaps(self) -> bool:
        return self is SchedulerMode.OVERLAP


class OutputDelivery(_FlagChoice):
    """When the engine thread hands a step's outputs to their sinks (``--output-delivery``).

    ``at-once`` (the default): as soon as a step is read. ``next-issue``: with a step in flight (the
    overlapped scheduler), once the next step is issued, just before the engine thread waits for the
    device: the sinks wake the HTTP event loop, whose Python then runs while the engine thread holds no
    interpreter lock instead of while it issues; a token leaves one issue later. With nothing in flight
    (the serial scheduler, the last step) both deliver at once. Measured on H200s (docs/tensor-parallel.md,
    "Round 12"): ``next-issue`` cut the one-GPU 8B server's decode issue at 64 streams from 2.39 to 0.54 ms
    (two calls), its share spent waiting from 0.53 to 0.06, but in one A/B on Qwen3-0.6B at 32 streams it
    served 9182 tokens/s against ``at-once``'s 11025. So ``at-once`` stays the default.
    """

    AT_ONCE = "at-once"
    NEXT_ISSUE = "next-issue"

    @classmethod
    def setting(cls) -> str:
        return "output delivery"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches.

    ``max_running_requests``: requests decoding or filling at once (also the decode graphs' largest
    batch). ``token_budget``: tokens one step may compute (the prefill graphs' largest size; at least
    ``max_running_requests`` so every running request can decode in a mixed step). ``mixed_steps``: carry
    decode tokens in prefill steps as one-token chunks (one forward per step) instead of running a decode
    step and a prefill step.

    ``deterministic``: every step has one fixed shape per phase (decode: ``max_running_requests`` rows;
    prefill: ``token_budget`` tokens and ``max_running_requests`` requests, padded by the engine) and
    decodes never ride in prefill steps. Matrix-multiply kernels (cuBLAS, MKL) and the split-KV decode
    attention choose their reduction order from the batch shape, so without this a request's logits can
    move in the last bits with the number of other requests in the step, and a greedy token can flip
    where two logits are nearly tied. With it, a request's tokens depend only on the request, with graphs
    or without. It costs the padding (and one graph per phase instead of a size ladder).

    ``scheduler``: :class:`SchedulerMode` (or its value): ``overlap`` (the default) or ``serial``.
    """

    max_running_requests: int = 8
    token_budget: int = 256
    mixed_steps: bool = True
    deterministic: bool = False
    scheduler: SchedulerMode = SchedulerMode.OVERLAP

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheduler", SchedulerMode.parse(self.scheduler))
        for name in ("max_running_requests", "token_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if self.token_budget < self.max_running_requests:
            raise ConfigError(
                f"EngineConfig.token_budget ({self.token_budget}) must be >= max_running_requests "
                f"({self.max_running_requests}): every running request must fit one step"
            )

    @property
    def mixed(self) -> bool:
        """Whether decode tokens share prefill steps (never in deterministic mode)."""
        return self.mixed_steps and not self.deterministic
