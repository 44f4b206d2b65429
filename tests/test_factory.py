"""create_backend: (device, phase, mode) -> backend."""

from __future__ import annotations

import pytest

from devgraph import BackendUnavailableError, ConfigError, create_backend
from devgraph.factory import best_platform, resolve_platform
from devgraph.strategies import BreakableBackend, EagerBackend, FullGraphBackend, TcPiecewiseBackend


def test_auto_picks_platform_defaults():
    assert type(create_backend("cpu", "decode")) is FullGraphBackend
    assert type(create_backend("cpu", "prefill")) is BreakableBackend


@pytest.mark.parametrize(
    ("mode", "cls"),
    [
        ("full", FullGraphBackend),
        ("breakable", BreakableBackend),
        ("tc_piecewise", TcPiecewiseBackend),
        ("disabled", EagerBackend),
        ("eager", EagerBackend),
    ],
)
def test_named_modes(mode, cls):
    backend = create_backend("cpu", "prefill", mode)
    assert type(backend) is cls
    assert backend.phase == "prefill" and backend.platform.name == "cpu"


def test_unknown_mode_lists_what_exists():
    with pytest.raises(BackendUnavailableError, match="available there: .*breakable"):
        create_backend("cpu", "decode", "warp")


def test_unknown_phase():
    with pytest.raises(ConfigError, match="accepted: decode, prefill, encode"):
        create_backend("cpu", "decoding")


def test_options_reach_the_backend():
    backend = create_backend("cpu", "prefill", "tc_piecewise", options={"compiler": "inductor"})
    assert backend.compiler == "inductor"
    with pytest.raises(ConfigError, match="compiler 'gcc'"):
        create_backend("cpu", "prefill", "tc_piecewise", options={"compiler": "gcc"})


def test_best_platform_on_this_machine_is_usable():
    assert best_platform().availability().usable


def test_unusable_platform_says_why(registry):
    cuda = registry.platform("cuda")
    if cuda.availability():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(BackendUnavailableError, match="cannot run here: .*"):
        create_backend("cuda", "decode")


def test_unknown_device_type():
    with pytest.raises(BackendUnavailableError, match="no registered platform handles device 'meta'"):
        resolve_platform("meta")
