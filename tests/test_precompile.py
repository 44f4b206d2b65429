"""Warm starts without re-tracing (devgraph/strategies/precompile.py) and the start-up breakdown
(devgraph/strategies/compile_time.py).

The round trip through files in separate processes is in tests/test_artifacts.py; here: when torch's
ahead-of-time compile is used and when it is refused, a function rebuilt from bytes runs this process's
weights without dynamo tracing, and the clock splits a compile into torch's phases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from devgraph.strategies import precompile
from devgraph.strategies.adaptive import AdaptiveCompile, trampoline
from devgraph.strategies.compile_time import PHASES, StartupClock


@contextlib.contextmanager
def _counting_traces() -> Iterator[list[int]]:
    """Every dynamo trace, ahead of time or at a call, runs an instruction translator: count them."""
    from torch._dynamo import symbolic_convert

    traced: list[int] = []
    original = symbolic_convert.InstructionTranslatorBase.run

    def counting(self: Any) -> Any:
        traced.append(1)
        return original(self)

    symbolic_convert.InstructionTranslatorBase.run = counting  # type: ignore[method-assign]
    try:
        yield traced
    finally:
        symbolic_convert.InstructionTranslatorBase.run = original  # type: ignore[method-assign]


class Scale(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(8, 4, generator=generator), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_only_a_module_method_on_a_torch_with_external_data_is_precompiled(monkeypatch: Any) -> None:
    assert precompile.precompile_support(Scale(0).forward) is None  # torch 2.13 here has all of it
    reason = precompile.precompile_support(lambda x: x)
    assert reason is not None and "nn.Module" in reason

    from torch._dynamo.aot_compile import AOTCompiledFunction

    def old_serialize(cls: Any, fn: Any) -> bytes:  # the form of torch releases that pickle the module
        return b""

    monkeypatch.setattr(AOTCompiledFunction, "serialize", classmethod(old_serialize))
    reason = precompile.precompile_support(Scale(0).forward)
    assert reason is not None and "external_data" in reason


@pytest.mark.slow
def test_a_rebuilt_function_runs_without_dynamo_and_with_the_weights_of_this_process() -> None:
    source = Scale(0)
    compiled = torch.compile(trampoline(source.forward), backend="inductor", fullgraph=True)
    x = torch.randn(4, 8)
    torch._dynamo.maybe_mark_dynamic(x, 0)
    clock = StartupClock()
    with clock.timing(), AdaptiveCompile._patches(dynamic=True):  # devgraph's settings: a size of 1 too
        made = precompile.aot_compile(compiled, (x,), {})
    described = clock.describe()
    assert clock.compiling_calls == 1 and described["compile_total_s"] > 0 and described["inductor_s"] > 0
    assert set(PHASES) <= set(described)
    data = precompile.serialize(made, source.forward)
    assert source.w.numpy().tobytes() not in data  # the weights stay out of the file

    other = Scale(1)
    with _counting_traces() as traced:
        rebuilt = precompile.deserialize(data, other.forward)
        clock = StartupClock()
        for rows in (1, 3, 16):
            y = torch.randn(rows, 8)
            with clock.timing():
                assert rebuilt.accepts((y,), {})
                out = rebuilt(y)
                assert torch.allclose(out, other(y)) and not torch.allclose(out, source(y))
    assert traced == [] and clock.compiling_calls == 0 and rebuilt.calls == 3
    assert not rebuilt.accepts((torch.randn(3, 5),), {}) and rebuilt.rejected == 1  # a width never traced


@pytest.mark.cuda
def test_on_a_gpu_the_rebuilt_function_gives_the_cold_outputs_bit_for_bit() -> None:
    """Triton kernels in the saved function: rebuilt without a trace, the same bits as the function saved."""
    source = Scale(0).cuda().half()
    missing = precompile.precompile_support(source.forward)
    if missing is not None:  # torch 2.11 (the GPU image): warm starts take the traced path, tested elsewhere
        pytest.skip(f"no ahead-of-time compile here: {missing}")
    compiled = torch.compile(trampoline(source.forward), backend="inductor", fullgraph=True)
    x = torch.randn(4, 8, device="cuda", dtype=torch.half)
    torch._dynamo.maybe_mark_dynamic(x, 0)
    with AdaptiveCompile._patches(dynamic=True):
        made = precompile.aot_compile(compiled, (x,), {})
    data = precompile.serialize(made, source.forward)
    with _counting_traces() as traced:
        rebuilt = precompile.deserialize(data, source.forward)
        for rows in (1, 8, 32, 64):
            y = torch.randn(rows, 8, device="cuda", dtype=torch.half)
            assert rebuilt.accepts((y,), {}) and torch.equal(rebuilt(y), made(y))
    assert traced == []
