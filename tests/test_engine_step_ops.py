"""The torch ops the engine issues per steady-state decode step outside the graph replay (CPU, tiny preset,
simulated graphs): each is a launch of host time on a GPU, so these tests pin an upper bound on them (a
change that adds one fails here and says which phase grew), count them per phase with
:class:`~devgraph.serve.engine.step_ops.StepOps`, and check that the leaner paths (every pending id in one
gather, the sampled rows as a view, block-table writes without tensors) give the same greedy tokens."""

from __future__ import annotations

import json
import runpy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, SamplingParams
from devgraph.serve.engine.step_ops import DEVICE_PHASES, StepCount, StepOps

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

ROOT = Path(__file__).resolve().parents[1]

#: Per steady-state greedy decode step, at any batch (see benchmarks/bench_step_ops.py).
#: Device ops: the step's rows of the device's block tables (one gather; the host's gather of the tables
#: it replaced, which sent them whole in every message, counted as a host op), the pending ids' gather
#: (both written into the runner's static rows, so the runner copies neither), the runner's 3 other
#: static-input copies, the slot write (greedy tokens come out of the graph with the logits), the copy
#: back. A change that needs more should say why here.
MAX_DEVICE_OPS = 7
MAX_OPS = 30


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(ReferenceConfig.preset("tiny", max_requests=8), seed=0)


def _engine(model: ReferenceModel, **config: Any) -> Engine:
    settings: dict[str, Any] = {"max_running_requests": 8, "token_budget": 32, **config}
    return Engine(model, EngineConfig(**settings), device_graph_mode="auto", progress=False)


def _decode_steps(engine: Engine, batch: int, steps: int, max_tokens: int = 48) -> list[StepCount]:
    """``steps`` decode steps counted once ``batch`` greedy requests all decode (a KV-block boundary, at
    position 16 and 32, falls among them)."""
    for i in range(batch):
        engine.add_request([(5 * i + j) % 500 for j in range(6)], SamplingParams(max_tokens=max_tokens))
    while engine.num_waiting or engine.step_counts["decode"] < 3:
        engine.step()
    with StepOps(engine) as ops:
        for _ in range(steps):
            before = engine.step_counts.copy()
            engine.step()
            assert engine.step_counts - before == Counter(decode=1)
    return ops.steps


@pytest.mark.parametrize("batch", [1, 8])
def test_a_greedy_decode_step_issues_at_most_the_pinned_ops_outside_the_replay(
    model: ReferenceModel, batch: int
) -> None:
    engine = _engine(model)
    counted = _decode_steps(engine, batch, 20)
    assert engine.decode_runner.stats()["replays"] > 0  # the graphs replay: their own ops are not counted
    for step in counted:
        phases = step.as_dict()["phases"]
        # A step that crossed a block boundary sends the new table entries: on the CPU two more views of
        # the message (on a GPU its views are made once per layout), one write on the device.
        crossed = step.ops["tables"]["index_copy_"]
        assert step.device_ops - crossed <= MAX_DEVICE_OPS, phases
        assert step.total() - 3 * crossed <= MAX_OPS, phases
        # Every token pending: one gather; no copy-on-write, no log probabilities.
        assert step.ops["ids"] == Counter(index_select=1)
        # greedy tokens from the graph: only the write of each into its slot
        assert step.ops["sample"] == Counter(index_copy_=1)
        assert step.ops["runner"]["copy_"] == 3  # ids and block tables were written where the graph reads
        # The step's rows of the device's block tables; a step that crossed a block boundary also writes
        # the new entries into them (sent as Python arrays: no host op to make them).
        assert step.ops["tables"] in (Counter(index_select=1), Counter(index_select=1, index_copy_=1))
        assert "cow" not in step.kinds
        # the runner's static rows that the ids and the tables are written into: two views, no device work
        assert step.ops["device"] == Counter(slice=2)
        assert "schedule" not in step.kinds  # a block crossed: written into the tables without torch ops
        assert step.copies["message"] == 1 and step.copies["to_host"] == 1
        assert step.events["to_host"] == 1
    # Every step alike but for the block tables' new entries on a block boundary (and their views).
    skipped = ("tables", "message")
    assert (
        len({str({k: v for k, v in c.as_dict()["phases"].items() if k not in skipped}) for c in counted}) == 1
    )
    assert any(c.ops["tables"]["index_copy_"] for c in counted)  # a boundary was crossed (position 16 or 32)
    engine.close()


def test_the_census_separates_the_replay_and_restores_the_engine(model: ReferenceModel) -> None:
    engine = _engine(model)
    step, run = engine.step, engine.decode_runner.run
    counted = _decode_steps(engine, 2, 2)
    assert engine.step == step and engine.decode_runner.run == run
    assert "step" not in engine.__dict__ and "run" not in engine.decode_runner.__dict__
    kinds = counted[0].kinds
    # 3 of the 5 inputs staged (a slice and a copy each), not the forward; the ids and the block tables
    # were written into the static rows before run(); the two outputs (logits, greedy tokens) cut to the
    # step's rows: two views
    assert kinds["runner"] == Counter(kernel=3, view=5)
    assert set(kinds) - {"stage", "plan", "read"} <= DEVICE_PHASES | {"engine"}
    engine.close()


def test_requests_that_ask_for_more_pay_for_it_and_only_they(model: ReferenceModel) -> None:
    """Sampling and log probabilities add their ops to the steps that carry such a request alone."""
    engine = _engine(model)
    engine.add_request(list(range(1, 7)), SamplingParams(max_tokens=40, temperature=0.8, seed=1))
    engine.add_request(list(range(7, 13)), SamplingParams(max_tokens=40, logprobs=2))
    counted = _decode_steps(engine, 1, 3, max_tokens=40)
    for step in counted:
        assert step.device_ops > MAX_DEVICE_OPS
        assert sum(step.ops["sample"].values()) > 1 and step.copies["to_host"] == 6
    engine.close()


@pytest.mark.parametrize("deterministic", [False, True])
def test_greedy_tokens_are_the_serial_engines_with_every_id_from_its_slot(
    model: ReferenceModel, deterministic: bool
) -> None:
    """Overlapped decode takes every id from its slot in one gather (padding rows from the padding slot,
    in deterministic mode) and samples the leading logits rows as a view: the serial engine, whose ids
    are all known and which gathers nothing, gives the same tokens."""
    prompts = [[(7 * i + j) % 500 for j in range(3 + 5 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=24)
    outputs = {}
    for scheduler in ("serial", "overlap"):
        engine = _engine(model, scheduler=scheduler, deterministic=deterministic)
        seen: list[dict[str, torch.Tensor]] = []

        def spy(
            kind: str, message: Any, arrays: dict[str, torch.Tensor], context: Any,
            seen: list[dict[str, torch.Tensor]] = seen, launch: Any = engine.launch,
        ) -> Any:  # fmt: skip
            seen.append(dict(arrays))
            return launch(kind, message, arrays, context)

        engine.launch = spy  # type: ignore[method-assign]
        outputs[scheduler] = engine.generate(prompts, params)
        decodes = [a for a in seen if "sample_rows" not in a and "cu_seqlens_q" not in a]
        assert decodes  # decode steps sample their leading rows: no gather of sampled rows
        if scheduler == "overlap":
            assert any("pending_slots" in a for a in decodes)
            if deterministic:  # padded to 8 rows: the padding rows read the padding slot (row 8)
                padded = [a["pending_slots"].tolist() for a in decodes if "pending_slots" in a]
                assert any(p[-1] == engine.tables.padding_row for p in padded)
        else:
            assert not any("pending_slots" in a or "id_slots" in a for a in seen)
        assert not engine.device_step.slots.tokens[engine.tables.padding_row]  # never written
        engine.close()
    assert outputs["overlap"] == outputs["serial"]


def test_the_benchmark_counts_and_writes_its_report(tmp_path: Path) -> None:
    bench: dict[str, Any] = runpy.run_path(str(ROOT / "benchmarks" / "bench_step_ops.py"), run_name="bench")
    out = tmp_path / "ops.json"
    assert bench["main"](["--batches", "1", "2", "--steps", "3", "--time-steps", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["torch"] == torch.__version__ and "bench_step_ops.py" in report["meta"]["command"]
    for batch in ("1", "2"):
        result = report["batches"][batch]
        assert result["device_ops"] <= MAX_DEVICE_OPS and result["ops"] <= MAX_OPS
        assert result["typical_step"]["phases"]["ids"]["ops"] == {"index_select": 1}
