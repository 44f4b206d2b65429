"""The checks of the conformance kit, one function per clause of the backend contract.

Each check builds its own runner(s) with a fresh instance of the target backend, on the platform's
default device, and raises :class:`CheckFailed` with what went wrong and what the contract says. The
checks live by theme in ``_checks_data`` (what a replay computes and writes), ``_checks_lifecycle``
(keys, failed captures, release, cleanup, ownership), ``_checks_keys`` (variants, lazily captured
keys) and ``_checks_context`` (break ops, ``is_replaying()``,
host inputs); docs/conformance.md says what each one proves.
"""

from __future__ import annotations

from devgraph.testing._checks_context import check_break_ops, check_host_inputs, check_runtime_session
from devgraph.testing._checks_data import (
    check_eager_fallback,
    check_padding_rows,
    check_stale_inputs,
    check_stale_rows,
    check_static_addresses,
    check_step_once,
)
from devgraph.testing._checks_keys import check_lazy_capture, check_variants
from devgraph.testing._checks_lifecycle import (
    check_capture_errors,
    check_cleanup,
    check_failed_capture,
    check_has_shape,
    check_ownership,
)
from devgraph.testing._fixtures import KIT_MODEL_CONFIG
from devgraph.testing._kit import Check

__all__ = ["CHECKS", "KIT_MODEL_CONFIG"]

CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("static_addresses", "outputs keep their addresses across replays", check_static_addresses),
        Check("padding_rows", "padding rows get the fill; unowned KV blocks untouched", check_padding_rows),
        Check("stale_rows", "rows past the bucket are never re-run", check_stale_rows),
        Check("step_once", "the forward runs exactly once per step", check_step_once),
        Check(
            "stale_inputs",
            "fresh inputs seen; rebound state is stale and verify() catches it",
            check_stale_inputs,
        ),
        Check("eager_fallback", "steps past the largest size run eagerly", check_eager_fallback),
        Check("break_ops", "break ops and the live forward context", check_break_ops),
        Check("has_shape", "has_shape() exactly for captured keys", check_has_shape),
        Check("variants", "each variant value is a key of its own", check_variants),
        Check("failed_capture", "a failed capture_one leaves nothing behind", check_failed_capture),
        Check("cleanup", "release()/close() drop graphs, outputs and memory", check_cleanup),
        Check("lazy_capture", "keys captured on first sight, evicted, captured again", check_lazy_capture),
        Check(
            "capture_errors",
            "a host sync in capture gives CaptureError naming the size",
            check_capture_errors,
        ),
        Check("runtime_session", "is_replaying() set by runtime_session() only", check_runtime_session),
        Check("host_inputs", "host=True inputs reach replay() on the CPU", check_host_inputs),
        Check("ownership", "a backend serves one live runner", check_ownership),
    )
}
