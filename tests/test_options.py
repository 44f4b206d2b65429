"""A runner's plan: the flag and the constructor's arguments resolved once; every argument checked as the
flag's value is; the flag wins over an argument in one place; the plan is frozen and the parts read it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from devgraph import (
    BackendUnavailableError,
    ConfigError,
    GraphRunner,
    PhaseConfig,
    StaticInput,
    create_backend,
)
from devgraph.runner.options import FLAG_KEYS, RunnerPlan, flag_over_arguments

INPUTS = {"x": StaticInput(torch.float32, (3,))}


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def runner(phase: str = "decode", **kwargs: object) -> GraphRunner:
    kwargs.setdefault("sizes", [1, 2, 4])
    return GraphRunner(double, phase=phase, inputs=INPUTS, device="cpu", **kwargs)  # type: ignore[arg-type]


# -- every argument checked as the flag's value is ---------------------------------------------------------
def test_a_compiler_the_mode_would_ignore_is_refused_with_what_compiles():
    with pytest.raises(ConfigError) as info:
        runner(mode="breakable", compiler="inductor")
    message = str(info.value)
    assert "compiler 'inductor' would be ignored: backend 'breakable' does not compile" in message
    assert "full" in message and "tc_piecewise" in message


def test_an_unknown_compiler_is_refused_with_the_accepted_ones():
    with pytest.raises(ConfigError, match=r"decode compiler 'bogus' is not valid.*accepted: eager, inductor"):
        runner(mode="full", compiler="bogus")


def test_a_compiler_where_auto_resolves_to_a_strategy_that_does_not_compile_names_the_argument():
    # On the CPU, prefill's auto is breakable: the flag would say the same for its own compiler.
    with pytest.raises(ConfigError) as info:
        runner("prefill", compiler="inductor", sizes=[16])
    message = str(info.value)
    assert "mode 'auto' resolves to backend 'breakable', which does not compile" in message
    assert "the runner's arguments set compiler='inductor'" in message


@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        ("lazy", 1, "decode lazy must be True or False, got 1"),
        ("max_graphs", 0, r"decode max_graphs must be an int in \[1, "),
        ("max_graph_bytes", -1, r"decode max_graph_bytes must be an int in \[0, "),
        ("warmup_iters", 2.0, r"decode warmup_iters must be an int in \[0, 16\], got 2.0 \(a float\)"),
        ("sizes", [1, 0], "decode sizes entry must be an integer from 1 to 65536"),
        ("max_size", 10**9, "decode max_size must be an integer from 1 to 65536"),
        ("progress", "yes", "progress= must be True, False or None"),
        ("check_lockstep", None, "check_lockstep= must be True or False"),
        ("single_thread", 1, "single_thread= must be True or False"),
        ("capture_context", 3, "capture_context= must be a callable or None"),
        ("capture_hook", "hook", "capture_hook= must be a callable or None"),
        ("mode", 3, "mode= must be a strategy name"),
        ("record_steps", "no", "record_steps= must be True or False"),
        ("axes", "requests", r"decode runner axes= must be a mapping of axis name to its sizes"),
        ("variants", "greedy", r"decode runner variants= must be a mapping of variant name to its values"),
        ("output_axes", 3, "output_axes must be a list"),
    ],
)
def test_hostile_arguments_are_refused_before_anything_is_built(argument, value, expected):
    with pytest.raises(ConfigError, match=expected):
        runner(**{argument: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA (CUDA is usable here)")
def test_a_device_this_torch_cannot_use_is_refused_by_name():
    # cuda on a CPU-only torch: the platform is registered but unusable (torch's own AssertionError before).
    with pytest.raises(BackendUnavailableError, match=r"device 'cuda': platform '\w+' is unusable here"):
        GraphRunner(double, phase="decode", inputs=INPUTS, device="cuda", sizes=[1])


def test_a_compiler_for_a_backend_given_built_is_refused():
    backend = create_backend("cpu", "decode", "full")
    with pytest.raises(ConfigError, match="compiler= applies to the backend the runner builds"):
        runner(backend=backend, compiler="eager")


# -- the flag wins over the argument, in one place --------------------------------------------------------
def test_the_flag_wins_over_each_argument_it_also_sets():
    flag = '{"decode": {"backend": "full", "sizes": [2, 8], "warmup_iters": 0, "compiler": "eager"}}'
    with runner(config=flag, sizes=[1, 4], warmup_iters=3, max_size=8) as r:
        assert r.sizes == (2, 8) and r.warmup_iters == 0
        assert r.plan.resolved.config.compiler == "eager" and r.plan.resolved.config.max_size == 8
        assert r.config.source == flag  # the flag as given; the settings are the plan's


def test_flag_over_arguments_is_the_rule():
    flag = PhaseConfig(backend="full", max_size=8)
    settings = flag_over_arguments(flag, {"max_size": 4, "warmup_iters": 1, "lazy": None})
    assert (settings.backend, settings.max_size, settings.warmup_iters, settings.lazy) == ("full", 8, 1, None)
    assert set(FLAG_KEYS) < {f.name for f in dataclasses.fields(PhaseConfig)}


# -- the plan --------------------------------------------------------------------------------------------
def test_the_plan_is_frozen_and_says_what_the_runner_resolved():
    with runner(mode="full", warmup_iters=1) as r:
        plan = r.plan
        assert isinstance(plan, RunnerPlan)
        assert (plan.phase, plan.platform.name, plan.resolved.backend) == ("decode", "cpu", "full")
        assert plan.schedule.token_sizes == (1, 2, 4) and plan.capture.warmup_iters == 1
        assert (r.phase, r.device, r.schedule, r.input_specs) == (
            plan.phase,
            plan.device,
            plan.schedule,
            plan.inputs,
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.phase = "prefill"  # type: ignore[misc]
        with pytest.raises(TypeError):
            plan.inputs["y"] = StaticInput(torch.float32)  # type: ignore[index]


def test_single_thread_runs_the_same_steps_without_the_lock():
    with runner(mode="full", single_thread=True) as lone, runner(mode="full") as shared:
        lone.capture()
        shared.capture()
        x = torch.randn(3, 3)
        torch.testing.assert_close(lone.run(x=x), shared.run(x=x))
        assert lone.plan.safety.single_thread and not shared.plan.safety.single_thread
        assert lone.stats()["replays"] == 1


def test_an_input_the_forward_does_not_take_is_named_before_any_compile():
    # before: reported at capture as "torch.compile cannot trace the forward"
    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids * 2

    spec = StaticInput(torch.long, fill=0)
    config = '{"decode": {"backend": "full", "compiler": "eager"}}'
    with pytest.raises(ConfigError, match="takes no parameter named 'ids'.*forward\\(input_ids"):
        GraphRunner(forward, phase="decode", inputs={"ids": spec}, device="cpu", config=config)
    with pytest.raises(ConfigError, match="it requires 'mask', which no input or variant provides"):
        GraphRunner(lambda ids, mask: ids, phase="decode", inputs={"ids": spec}, device="cpu")
    GraphRunner(lambda **inputs: inputs["ids"], phase="decode", inputs={"ids": spec}, device="cpu")
    window = {"window": (8, 16)}
    GraphRunner(lambda ids, window: ids, phase="decode", inputs={"ids": spec}, device="cpu", variants=window)
