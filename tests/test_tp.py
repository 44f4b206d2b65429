"""Tensor parallelism: collectives inside graphs, the ranks' capture handshake, lock-step, teardown.

Each test launches ``tests/tp_worker.py`` as two ranks (torchrun's environment, 127.0.0.1, a free port)
and reads what each rank wrote. CPU: gloo over the CPU simulator (runs in CI). ``multi_gpu``: NCCL on two
GPUs; ``DEVGRAPH_TP_RESULTS=FILE`` keeps the ranks' findings in one JSON file (a recorded run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks_launch import free_port, launch_ranks

from devgraph import ranks
from devgraph.errors import ConfigError
from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch, make_prefill_batch
from devgraph.reference.tp import TPReferenceModel
from devgraph.reference.tp.comm import symm_plan, symm_unavailable_reason

WORKER = Path(__file__).with_name("tp_worker.py")
RANK_TIMEOUT_S = 10  # DEVGRAPH_RANK_TIMEOUT_S for the launches: short, so a broken handshake fails fast


def launch(
    scenarios: str,
    out: Path,
    *,
    device: str = "cpu",
    extra: tuple[str, ...] = (),
    limit: float = 240,
    timeout: float = RANK_TIMEOUT_S,
) -> dict[int, Any]:
    """Run the worker as ranks 0 and 1; returns each rank's findings (and its exit code and log)."""
    return launch_ranks(WORKER, scenarios, out, device=device, extra=extra, limit=limit, timeout=timeout)


def _check_scenario(found: dict[int, Any], name: str, ranks_: tuple[int, ...] = (0, 1)) -> list[Any]:
    results = []
    for rank in ranks_:
        result = found[rank].get(name)
        assert result is not None, f"rank {rank} recorded nothing for {name}:\n{found[rank]['log']}"
        assert "crashed" not in result, f"rank {rank} {name}: {result['crashed']}\n{result.get('traceback')}"
        results.append(result)
    return results


# -- what the ranks check ---------------------------------------------------------------------------------
def check_equivalence(found: dict[int, Any], *, exact: bool, modes: tuple[str, ...]) -> None:
    for rank, result in enumerate(_check_scenario(found, "equivalence")):
        configs = {k: v for k, v in result.items() if isinstance(v, dict) and "steps" in v}
        # One capture report per runner, logged by rank 0 only.
        assert result["capture_reports_logged"] == (len(configs) if rank == 0 else 0), result
        assert {k.split("/")[0] for k in configs} == set(modes)
        for name, config in configs.items():
            assert config["replays"] > 0, (rank, name)
            for step in config["steps"]:
                assert step["replayed"], (rank, name, step)
                # Graph vs eager over the same padded buffers: the same kernels, so the same numbers.
                limit = 0.0 if exact else 1e-5 * max(1.0, step["scale"])
                assert step["graph_vs_eager_padded"] <= limit, (rank, name, step)
                assert step["graph_vs_eager_same_rows"] <= 1e-4 * max(1.0, step["scale"]), (rank, name, step)
            # The communicator's context is entered once around the whole capture, and every all-reduce
            # captured happened inside it (two per layer per key where the forward runs in Python).
            events = config["hook_events"]
            assert events[0] == "enter" and events[-1] == "exit" and events.count("enter") == 1, events
            assert not [e for e in events if e.startswith("all-reduce")], events
            # capture_context saw each key (and the output-layout probe may ask again).
            seen = {int(e.split()[1]) for e in events if e.startswith("key")}
            assert set(config["key_tokens"]) <= seen and len(seen) <= len(config["key_tokens"]) + 1, seen
            if not name.startswith("tc_piecewise"):  # compiled code calls no Python at capture
                assert config["registered_buffers"] == 2 * 2 * len(config["keys"]), config
            if rank == 1:  # every rank returns the full logits: the same numbers on both
                other = found[0]["equivalence"][name]["steps"]
                assert [s["checksum"] for s in config["steps"]] == [s["checksum"] for s in other], name
        single = result["tp_vs_single_device"]
        for part in ("decode", "prefill", "torch_comm_eager", "torch_comm_compiled"):
            assert single[part] <= 1e-4 * max(1.0, single["scale"]), single


def check_capture_error(found: dict[int, Any]) -> None:
    for rank, result in enumerate(_check_scenario(found, "capture_error")):
        raised = result["raised"]
        assert raised is not None and raised["type"] == "CaptureError", result
        assert "on rank 1" in raised["message"] and f"tokens={2}" in raised["message"], raised
        assert "injected failure" in raised["message"], raised
        assert raised["seconds"] < RANK_TIMEOUT_S, raised
        assert result["keys_left"] == [], f"rank {rank} kept graphs after the failure"


def check_different_keys(found: dict[int, Any]) -> None:
    for result in _check_scenario(found, "different_keys"):
        raised = result["raised"]
        assert raised is not None and raised["type"] == "CaptureError", result
        assert "different decode keys" in raised["message"], raised
        assert "tokens=4" in raised["message"] and "tokens=8" in raised["message"], raised
        assert result["all_reduces_run"] == 0, result  # stopped before any warm-up


def check_lockstep(found: dict[int, Any]) -> None:
    for result in _check_scenario(found, "lockstep"):
        raised = result["raised"]
        assert raised is not None and raised["type"] == "ReplayError", result
        assert "rank 0: tokens=1" in raised["message"] and "rank 1: tokens=4" in raised["message"], raised
        assert result["same_key_after"] == 4


def check_teardown(found: dict[int, Any]) -> None:
    for result in _check_scenario(found, "teardown"):
        for part in ("destroy_first", "devgraph_destroy"):
            assert result[part]["closed_by_destroy"] and not result[part]["group_alive"], result
        assert result["close_then_destroy"]["initialized"] is False
        assert all(part["seconds"] < RANK_TIMEOUT_S for part in result.values()), result


def check_destroy_bypassed(found: dict[int, Any], *, device: bool) -> None:
    for rank, result in enumerate(_check_scenario(found, "destroy_bypassed")):
        assert found[rank]["exit"] == 0, found[rank]["log"]
        assert result["close_seconds"] < RANK_TIMEOUT_S, result
        if not device:  # gloo frees at once; the simulator's graphs are plain objects, freed by close()
            assert result["destroy_returned_within_15s"] and result["close_kept_graphs"] == 0, result


def check_peer_lost(found: dict[int, Any], name: str, *, limit: float) -> float:
    """Rank 0 stops with a CaptureError naming the key and what happened, within ``limit`` seconds of rank
    1 dying or hanging; returns that delay."""
    survivor = found[0].get(name)
    assert survivor is not None and "crashed" not in survivor, found[0]["log"]
    raised = survivor["raised"]
    assert raised is not None and raised["type"] == "CaptureError", survivor
    assert f"tokens={2}" in raised["message"], raised
    assert "died or did not answer" in raised["message"], raised
    assert "rank1_at" in found[1], found[1]["log"]
    delay = survivor["raised_at"] - found[1]["rank1_at"]
    assert 0 <= delay < limit, (delay, raised)
    assert found[0]["exit"] == 0, found[0]["log"]
    return delay


# -- CPU: gloo over the simulator --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    out = tmp_path_factory.mktemp("tp")
    return launch(
        "equivalence,lockstep,capture_error,different_keys,destroy_bypassed,teardown",
        out,
        extra=("--comms", "auto"),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "compiler",
    [
        "eager",
        pytest.param(
            "inductor",
            marks=pytest.mark.skipif(
                os.environ.get("DEVGRAPH_FULL_MATRIX") != "1",
                reason="inductor on two CPU ranks takes minutes: DEVGRAPH_FULL_MATRIX=1",
            ),
        ),
    ],
)
def test_compiled_full_with_collectives_inside_equals_eager_tp(tmp_path, compiler):
    found = launch("compiled_full", tmp_path, extra=("--compiler", compiler), limit=480)
    results = _check_scenario(found, "compiled_full")
    for rank, result in enumerate(results):
        for comm in ("op", "torch"):
            for step in result[comm]["steps"]:
                assert step["replayed"], (rank, comm, step)
                assert step["graph_vs_eager_padded"] == 0.0, (rank, comm, step)  # the same compiled code
                assert step["graph_vs_eager_same_rows"] <= 1e-4 * max(1.0, step["scale"]), (rank, comm, step)
    for comm in ("op", "torch"):  # every rank returns the full logits: the same numbers on both
        assert [s["checksum"] for s in results[0][comm]["steps"]] == [
            s["checksum"] for s in results[1][comm]["steps"]
        ]


def check_fallback(found: dict[int, Any]) -> None:
    results = _check_scenario(found, "fallback")
    for rank, result in enumerate(results):
        for comm, run in result.items():
            assert run["fallback_keys"] == [1, 2, 4], (rank, comm, run)  # tp_worker.DECODE_SIZES
            # Steps of 1 and 3 rows are vetoed by full and replay the fallback's graphs; 4 replays full.
            assert run["fallback"]["by_reason"]["backend_declined"] >= 2, (rank, comm, run)
            assert run["eager"] == 0, (rank, comm, run)
            for step in run["steps"]:
                assert step["replayed"], (rank, comm, step)
                assert step["graph_vs_eager_same_rows"] <= 1e-4 * max(1.0, step["scale"]), (rank, comm, step)
    for comm in results[0]:
        assert [s["checksum"] for s in results[0][comm]["steps"]] == [
            s["checksum"] for s in results[1][comm]["steps"]
        ]


def test_the_fallback_graph_set_replays_what_full_declines_on_every_rank(tmp_path):
    check_fallback(launch("fallback", tmp_path, extra=("--comms", "op,torch"), limit=240))


def test_replays_equal_eager_tp_under_every_mode(cpu_run):
    check_equivalence(cpu_run, exact=True, modes=("full", "breakable", "tc_piecewise"))


def test_a_capture_error_on_one_rank_is_raised_on_every_rank(cpu_run):
    check_capture_error(cpu_run)


def test_lockstep_check_names_the_ranks_and_keys_that_differ(cpu_run):
    check_lockstep(cpu_run)


def test_ranks_with_different_keys_stop_before_warming_up(cpu_run):
    check_different_keys(cpu_run)


def test_teardown_order(cpu_run):
    check_teardown(cpu_run)
    check_destroy_bypassed(cpu_run, device=False)
    assert cpu_run[0]["exit"] == 0 and cpu_run[1]["exit"] == 0, (cpu_run[0]["log"], cpu_run[1]["log"])


def test_killing_a_rank_mid_capture_stops_the_other_within_the_timeout(tmp_path):
    # Killed between two keys; killed half-way through a warm-up runs in the multi_gpu test (on gloo the
    # survivor's own collective fails at once, so it adds little here but a launch).
    found = launch("kill", tmp_path, extra=("--group-timeout", str(RANK_TIMEOUT_S)), limit=60)
    assert found[1]["exit"] == -9, found[1]["log"]  # SIGKILL, as planned
    check_peer_lost(found, "kill", limit=RANK_TIMEOUT_S)


def test_a_rank_that_hangs_mid_capture_stops_the_other_after_the_timeout(tmp_path):
    timeout = 4.0  # rank 1 sleeps timeout + 4 s: the test takes about 12 s, nearly all of it asleep
    found = launch("stall", tmp_path, extra=("--group-timeout", "30"), limit=60, timeout=timeout)
    delay = check_peer_lost(found, "stall", limit=timeout + 3)
    assert delay >= timeout * 0.9, delay  # it did wait for the rank


# -- one process, no launch -----------------------------------------------------------------------------
def test_one_rank_equals_the_single_device_model():
    config = ReferenceConfig.preset("tiny", kernels="torch")
    single = ReferenceModel(config, seed=3)
    single.randomize_cache(seed=1)
    model = TPReferenceModel(config, None, seed=3)
    model.copy_cache_from(single)
    decode = make_decode_batch(single, 5, seed=2)
    prefill = make_prefill_batch(single, [3, 7], prefix_lens=[4, 0])
    with torch.no_grad():
        assert torch.equal(model.decode_step(**decode), single.decode_step(**decode))
        assert torch.equal(model.prefill_step(**prefill), single.prefill_step(**prefill))


def test_rank_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(ranks.RANK_TIMEOUT_ENV, raising=False)
    assert ranks.rank_timeout_s() == ranks.DEFAULT_RANK_TIMEOUT_S
    monkeypatch.setenv(ranks.RANK_TIMEOUT_ENV, "2.5")
    assert ranks.rank_timeout_s() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(ranks.RANK_TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=ranks.RANK_TIMEOUT_ENV):
            ranks.rank_timeout_s()


def test_a_process_group_without_torch_distributed_is_refused():
    class Group:  # what a caller might hold before init_process_group()
        group_name = "0"

    with pytest.raises(ConfigError, match="init_process_group"):
        TPReferenceModel(ReferenceConfig.preset("tiny"), Group())


def test_the_simulator_records_a_c10d_collective(unused_port):
    import torch.distributed as dist

    from devgraph.platforms.sim.graph import SimGraph, abort_capture

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{unused_port}", rank=0, world_size=1)
    graph = SimGraph()
    try:
        x = torch.ones(4)
        graph.capture_begin()
        y = x * 2
        dist.all_reduce(y)
        graph.capture_end()
        x.fill_(3.0)
        graph.replay()
        assert torch.equal(y, torch.full((4,), 6.0))
    finally:
        abort_capture(graph)
        dist.destroy_process_group()


@pytest.fixture
def unused_port() -> int:
    return free_port()


# -- two GPUs: NCCL -------------------------------------------------------------------------------------
def _record(name: str, found: dict[int, Any]) -> None:
    """With ``DEVGRAPH_TP_RESULTS=FILE``, keep what the ranks found (merged into one JSON file)."""
    target = os.environ.get("DEVGRAPH_TP_RESULTS")
    if not target:
        return
    path = Path(target)
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[name] = {"torch": torch.__version__, "ranks": found}
    path.write_text(json.dumps(merged, indent=1, default=str))


@pytest.mark.multi_gpu
def test_nccl_replays_equal_eager_tp_and_ranks_fail_together(tmp_path):
    found = launch(
        "equivalence,lockstep,capture_error,different_keys,teardown",
        tmp_path,
        device="cuda",
        extra=("--comms", "torch,op"),
        limit=240,
    )
    _record("nccl", found)
    check_equivalence(found, exact=False, modes=("full", "breakable", "tc_piecewise"))
    check_lockstep(found)
    check_capture_error(found)
    check_different_keys(found)
    check_teardown(found)


@pytest.mark.multi_gpu
def test_nccl_compiled_full_and_the_fallback_set_equal_eager_tp(tmp_path):
    # Inductor compiles the forward with the NCCL collectives inside (both communicators), then the fallback
    # graph set replays the steps full declines.
    found = launch(
        "compiled_full,fallback",
        tmp_path,
        device="cuda",
        extra=("--compiler", "inductor", "--comms", "op,torch"),
        limit=420,
    )
    _record("nccl-compiled-full-fallback", found)
    results = _check_scenario(found, "compiled_full")
    for rank, result in enumerate(results):
        for comm in ("op", "torch"):
            for step in result[comm]["steps"]:
                assert step["replayed"], (rank, comm, step)
                assert step["graph_vs_eager_padded"] == 0.0, (rank, comm, step)  # the same compiled code
    check_fallback(found)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("scenario", ["kill", "kill_in_warmup", "stall"])
def test_nccl_a_lost_rank_stops_the_other_within_the_timeout(tmp_path, scenario):
    # The NCCL group's own timeout is long: the handshake on the gloo control group must end it first.
    found = launch(
        scenario, tmp_path, device="cuda", extra=("--modes", "full", "--group-timeout", "300"), limit=75
    )
    _record(f"nccl-{scenario}", found)
    # Killed: at once (gloo sees the closed connection) plus the grace for queued device work; hung:
    # the control group's timeout plus that grace.
    check_peer_lost(found, scenario, limit=RANK_TIMEOUT_S + 10)


@pytest.mark.multi_gpu
def test_nccl_close_after_a_bypassed_destroy_neither_fails_nor_hangs(tmp_path):
    found = launch("destroy_bypassed", tmp_path, device="cuda", extra=("--modes", "full"), limit=75)
    _record("nccl-destroy-bypassed", found)
    check_destroy_bypassed(found, device=True)


def test_the_simulator_waits_for_a_functional_collective_before_reading_it(unused_port):
    # dynamo turns dist.all_reduce into _c10d_functional.all_reduce + wait_tensor: replay must wait for the
    # fresh result before copying it where the graph's later ops read it.
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from devgraph.platforms.sim.graph import SimGraph, abort_capture

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{unused_port}", rank=0, world_size=1)
    graph = SimGraph()
    try:
        x = torch.ones(64)
        graph.capture_begin()
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
        graph.capture_end()
        for step in range(200):
            x.fill_(float(step))
            graph.replay()
            assert torch.equal(y, torch.full((64,), 2.0 * step + 1)), step
    finally:
        abort_capture(graph)
        dist.destroy_process_group()


# -- comm="symm": torch symmetric memory -------------------------------------------------------------------
def test_symm_plan_picks_the_op_by_size_dtype_and_alignment():
    bf16, plan = torch.bfloat16, symm_plan
    kw = {"buffer_dtype": bf16, "capacity": 8 << 20, "one_shot_max": 512 << 10}
    assert plan(4096 * 2, bf16, **kw) == "one_shot_copy"  # decode, batch 1
    assert plan(64 * 4096 * 2, bf16, **kw) == "one_shot_copy"  # batch 64: 512 KiB, the limit itself
    assert plan(65 * 4096 * 2, bf16, **kw) == "two_shot_out"
    assert plan(8 << 20, bf16, **kw) == "two_shot_out"  # the whole buffer
    assert plan((8 << 20) + 4, bf16, **kw) == "nccl"  # past it
    assert plan(4096 * 2, bf16, **kw, fused_copy=False) == "one_shot"  # a torch without the fused op
    assert plan(4096 * 2, bf16, **kw, aligned=False) == "two_shot"  # staged through the buffer
    assert plan(65 * 4096 * 2, bf16, **kw, world_size=3) == "two_shot"  # the out-variant takes 2, 4, 8
    assert plan(4096 * 2, torch.float32, **kw) == "nccl"  # not the buffer's dtype
    assert plan(4096 * 2, bf16, **kw, contiguous=False) == "nccl"
    assert plan(6, bf16, **kw) == "nccl"  # 3 bf16: not a whole number of 4-byte words
    assert plan(0, bf16, **kw) == "nccl"
    assert plan(4096 * 2, bf16, buffer_dtype=None, capacity=0) == "nccl"  # no buffer


def test_symm_unavailable_reasons_name_what_is_missing():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    ok = {"device": cuda, "backend": "nccl", "world_size": 2, "dtype": torch.bfloat16}
    assert symm_unavailable_reason(**ok) is None
    assert symm_unavailable_reason(**{**ok, "backend": "cpu:gloo,cuda:nccl"}) is None
    assert "cpu" in symm_unavailable_reason(**{**ok, "device": cpu})
    assert "gloo" in symm_unavailable_reason(**{**ok, "backend": "gloo"})
    assert "one rank" in symm_unavailable_reason(**{**ok, "world_size": 1})
    assert "float16" in symm_unavailable_reason(**{**ok, "dtype": torch.float16})


def test_symm_on_one_rank_is_the_auto_mode_and_says_why():
    model = TPReferenceModel(ReferenceConfig.preset("tiny", kernels="torch"), comm="symm")
    assert model.comm.mode == "op" and model.comm.symm is None
    assert "one rank" in model.comm.fallback_reason
    with pytest.raises(ConfigError, match="symm"):
        TPReferenceModel(ReferenceConfig.preset("tiny", kernels="torch"), comm="nvls")


def check_symm(found: dict[int, Any], *, device: bool) -> None:
    for rank, result in enumerate(_check_scenario(found, "symm")):
        if device:
            assert result["mode"] == "symm", result
            assert result["direct_mode"] == "symm", result
            plans = {name: c["plan"] for name, c in result["all_reduce"].items()}
            assert plans == {
                "1": "one_shot_copy",
                "8": "one_shot_copy",
                "64": "two_shot_out",
                "300": "nccl",
                "8+odd": "two_shot",
            }, plans
            if rank == 0:
                assert any(line.startswith("INFO") and "symmetric memory" in line for line in result["log"])
        else:  # gloo on the CPU: what auto picks, and one warning saying why
            assert result["mode"] == "op" and result["direct_mode"] == "op", result
            assert "cpu" in result["fallback_reason"], result
            warned = [line for line in result["log"] if line.startswith("WARNING")]
            assert len(warned) == 1 and "comm='symm' asked, using 'op'" in warned[0], result["log"]
        for name, check in result["all_reduce"].items():
            assert check["max_abs_diff"] == 0, (rank, name, check)
        for step in result["steps"]:
            assert step["graph_vs_eager"] <= 1e-5 * max(1.0, step["scale"]), (rank, step)
            assert step["vs_torch_comm"] <= 1e-4 * max(1.0, step["scale"]), (rank, step)


def test_symm_on_gloo_falls_back_to_op_and_logs_why(tmp_path):
    check_symm(launch("symm", tmp_path, limit=240), device=False)


def test_fused_all_reduce_on_gloo_is_not_set_up(tmp_path):
    for result in _check_scenario(launch("fused", tmp_path, limit=240), "fused"):
        # symm falls back (the CPU) before the fused set-up, on every rank alike; nothing is launched
        assert result["fused"] is None and result["mode"] == "op", result
        assert "cpu" in result["fallback_reason"] and result["fused_reason"] is None, result


@pytest.mark.multi_gpu
@pytest.mark.cuda
def test_fused_all_reduce_equals_nccl_and_the_add_norm_in_graphs_and_the_model(tmp_path):
    from devgraph.reference.tp.comm import FUSED_MAX_ROWS

    found = launch("fused", tmp_path, device="cuda", limit=300)
    _record("fused", found)
    results = _check_scenario(found, "fused")
    # Every rank reduced to the same bits, call after call.
    assert results[0]["back_to_back_digest"] == results[1]["back_to_back_digest"], results
    for result in results:
        assert result["fused"] is not None, result
        for name, row in result["eager"].items():
            rows = int(name.split("x")[0])
            assert row["fused"] == (rows <= FUSED_MAX_ROWS), (name, row)
            if row["fused"]:
                # The sums round as NCCL's sum then torch.add; the norm may differ in its reduction order.
                assert row["total"] == 0.0 and row["total_without_norm"] == 0.0, (name, row)
                assert row["normed"] <= 0.05 and row["no_normed_without_weight"], (name, row)
        assert result["graphs_alternating_max_diff"] <= 0.1, result
        assert result["back_to_back_total"] == 0.0 and result["back_to_back_normed"] <= 0.05, result
        assert result["model_fused_fused"] and result["model_late_fused"], result
        assert not result["model_unfused_fused"], result
        # The eager steps went through the kernel: two calls a layer a step (three decode sizes).
        steps = 2 * result["layers"] * len(result["model"])
        assert result["model_fused_eager_fused_calls"] == steps, result
        assert result["model_unfused_eager_fused_calls"] == 0, result
        for n, row in result["model"].items():
            # Against the unfused model's eager step before any capture: every run of both models, eager
            # before and after the capture and replayed, within rounding (the norm's order of squares).
            for name, value in row.items():
                if name != "scale":
                    assert value <= 1e-2 * max(1.0, row["scale"]), (
                        f"{n} {name}: {json.dumps(result['model'])}"
                    )


@pytest.mark.cuda
@pytest.mark.multi_gpu
def test_nccl_symm_all_reduce_equals_the_sum_and_graphs_equal_eager(tmp_path):
    found = launch("symm", tmp_path, device="cuda", limit=240)
    _record("symm", found)
    check_symm(found, device=True)
