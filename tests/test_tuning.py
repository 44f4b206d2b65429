"""Tuned capture sizes: the exact dynamic programme, the trace format, recording, ``devgraph tune``,
``retune()`` while serving and ``devgraph serve --tuned``."""

from __future__ import annotations

import itertools
import json
import random
import time
from collections import Counter
from typing import Any

import pytest
import torch

from devgraph import GraphRunner, StaticInput
from devgraph.cli.main import main
from devgraph.errors import ConfigError
from devgraph.flag.config import DeviceGraphConfig
from devgraph.flag.trace import PhaseSteps, load_steps, read_steps, write_trace
from devgraph.flag.tuning import (
    apply_tuned,
    graphs_for_bytes,
    optimal_sizes,
    padding_of,
    tune_phase,
    tuned_flag,
)

INPUTS = {"x": StaticInput(torch.float32, (4,))}


def brute_force(histogram: dict[int, int], graphs: int) -> int:
    """The least padding over every choice of at most ``graphs`` sizes among the counts seen."""
    values = sorted(histogram)
    best = None
    for k in range(1, min(graphs, len(values)) + 1):
        for chosen in itertools.combinations(values[:-1], k - 1):
            padded, past = padding_of(histogram, [*chosen, values[-1]])
            assert past == 0
            best = padded if best is None else min(best, padded)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_dynamic_programme_is_exact(seed):
    rng = random.Random(seed)
    histogram = {rng.randint(1, 60): rng.randint(1, 50) for _ in range(rng.randint(1, 11))}
    for graphs in range(1, 6):
        sizes = optimal_sizes(histogram, graphs)
        assert len(sizes) <= graphs and max(sizes) == max(histogram)
        padded, past = padding_of(histogram, sizes)
        assert past == 0 and padded == brute_force(histogram, graphs), (histogram, graphs, sizes)


def brute_force_within(histogram: dict[int, int], graphs: int, size_sum: int) -> int | None:
    values = sorted(histogram)
    best = None
    for k in range(1, min(graphs, len(values)) + 1):
        for chosen in itertools.combinations(values[:-1], k - 1):
            sizes = [*chosen, values[-1]]
            if sum(sizes) <= size_sum:
                padded = padding_of(histogram, sizes)[0]
                best = padded if best is None else min(best, padded)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_a_bound_on_the_sum_of_sizes_is_kept_and_close_to_the_best(seed):
    rng = random.Random(100 + seed)
    histogram = {rng.randint(1, 60): rng.randint(1, 50) for _ in range(rng.randint(2, 10))}
    largest = max(histogram)
    for size_sum in (largest, largest + 20, largest + 60):
        sizes = optimal_sizes(histogram, 4, size_sum=size_sum)
        assert sum(sizes) <= size_sum and max(sizes) == largest
        best = brute_force_within(histogram, 4, size_sum)
        assert best is not None and padding_of(histogram, sizes)[0] <= 1.1 * best, (histogram, size_sum)
    with pytest.raises(ConfigError, match="below the largest size"):
        optimal_sizes(histogram, 4, size_sum=largest - 1)


def test_top_is_kept_and_covers_nothing_seen():
    sizes = optimal_sizes({3: 10, 7: 1}, 2, top=64)
    assert sizes[-1] == 64 and 7 in sizes  # 7 is cheaper to keep than padding it to 64
    with pytest.raises(ConfigError, match="below the largest recorded count 7"):
        optimal_sizes({3: 10, 7: 1}, 2, top=5)


@pytest.mark.parametrize(
    ("histogram", "graphs", "message"),
    [
        ({}, 2, "no recorded steps"),
        ({4: 1}, 0, "from 1 to"),
        ({4: 1}, True, "from 1 to"),
        ({4: 0}, 1, "no recorded"),
    ],
)
def test_hostile_inputs_are_refused(histogram, graphs, message):
    with pytest.raises(ConfigError, match=message):
        optimal_sizes(histogram, graphs)


def test_many_distinct_counts_are_rounded_and_still_cover_everything():
    histogram = {n: 1 for n in range(1, 9001)}
    sizes = optimal_sizes(histogram, 16)
    assert len(sizes) <= 16 and max(sizes) >= 9000
    assert padding_of(histogram, sizes)[1] == 0


def test_a_skewed_trace_loses_most_of_its_padding_at_equal_graph_count():
    # Batches cluster just above the default sizes (e.g. 33 pads to 40): the tuned sizes sit on the clusters.
    rng = random.Random(0)
    steps = Counter(rng.choice([3, 5, 9, 17, 33, 65, 97, 129]) + rng.randint(0, 2) for _ in range(5000))
    recorded = PhaseSteps("decode", ("tokens",), Counter({(n,): c for n, c in steps.items()}))
    tuning = tune_phase(recorded)
    axis = tuning.axis("tokens")
    # Equal graph memory: no more graphs than the defaults up to the largest step, no larger sum of sizes.
    assert len(axis.sizes) <= len(axis.baseline) and sum(axis.sizes) <= sum(axis.baseline)
    assert axis.padded <= 0.5 * axis.baseline_padded, axis
    assert axis.cut >= 0.5
    assert tuned_flag([tuning]) == {"decode": {"sizes": list(axis.sizes)}}


def test_graph_bytes_budget_counts_graphs_from_the_recorded_bytes():
    # The largest graph holds the pool's peak (100); every further graph adds about 10.
    assert graphs_for_bytes(150, {64: 100, 32: 10, 16: 12, 8: 9}) == 6
    with pytest.raises(ConfigError, match="below the largest graph"):
        graphs_for_bytes(50, {64: 100})
    with pytest.raises(ConfigError, match="needs the bytes each captured key took"):
        graphs_for_bytes(50, {})


# -- the trace -------------------------------------------------------------------------------------------
def test_a_trace_round_trips_and_merges_phases(tmp_path):
    decode = PhaseSteps("decode", ("tokens",), Counter({(1,): 3, (5,): 2}), {"tokens": [1, 8]}, {8: 1024})
    more = PhaseSteps("decode", ("tokens",), Counter({(5,): 1}))
    prefill = PhaseSteps("prefill", ("tokens", "requests"), Counter({(96, 2): 7}))
    path = write_trace(tmp_path / "steps.json", [decode, more, prefill])
    loaded = load_steps(path)
    assert loaded["decode"].histogram == Counter({(1,): 3, (5,): 3})
    assert loaded["decode"].sizes == {"tokens": [1, 8]} and loaded["decode"].graph_bytes == {8: 1024}
    assert loaded["prefill"].axis("requests") == Counter({2: 7})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({"a": 1}, "is neither"),
        ({"format": "devgraph-steps", "version": 2, "phases": {}}, "version 2 is not 1"),
        ({"format": "devgraph-steps", "version": 1, "phases": {"dekode": {}}}, "is not a phase"),
        ({"format": "devgraph-steps", "version": 1, "phases": {"decode": {"steps": [[0, 1]]}}}, "from 1 to"),
        (
            {"format": "devgraph-steps", "version": 1, "phases": {"decode": {"steps": [[4]]}}},
            "holds 1 counts",
        ),
        ({"format": "devgraph-steps", "version": 1, "phases": {"decode": {"axes": ["requests"]}}}, "tokens"),
        ({"phase": "decode", "recorded": None}, "record_steps=True"),
        ("text", "must be a JSON object"),
    ],
)
def test_bad_traces_say_what_is_wrong(data, message):
    with pytest.raises(ConfigError, match=message):
        read_steps(data)


def test_an_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_steps(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_steps(tmp_path / "bad.json")


# -- recording, retuning ---------------------------------------------------------------------------------
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_runner_records_its_steps_and_stats_export_is_a_trace():
    runner = GraphRunner(double, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[2, 8])
    runner.capture()
    for n in (1, 3, 3, 9):
        runner.run(x=torch.ones(n, 4))
    assert runner.stats()["recorded"] is None  # off unless asked
    runner.record_steps()
    for n in (1, 3, 3, 9):
        runner.run(x=torch.ones(n, 4))
    stats = json.loads(json.dumps(runner.stats()))
    assert stats["recorded"] == {"steps": [[1, 1], [3, 2], [9, 1]]}
    assert read_steps(stats)["decode"].histogram == Counter({(1,): 1, (3,): 2, (9,): 1})
    recorded = runner.recorded_steps()
    assert recorded.sizes == {"tokens": [2, 8]} and set(recorded.graph_bytes) == {2, 8}
    runner.reset_stats()
    assert runner.stats()["recorded"] == {"steps": []}  # still recording after a reset
    runner.record_steps(False)
    with pytest.raises(ConfigError, match="not recording"):
        runner.recorded_steps()


def test_retune_keeps_the_graphs_that_stay_and_captures_new_keys_on_first_sight():
    runner = GraphRunner(double, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[2, 4, 8])
    runner.capture()
    new = runner.retune([3, 8])
    assert [k.tokens for k in new] == [3]
    assert [k.tokens for k in runner.keys] == [8]  # 2 and 4 released, 3 not captured yet
    out = runner.run(x=torch.full((3, 4), 1.5))
    torch.testing.assert_close(out, torch.full((3, 4), 3.0))
    assert [k.tokens for k in runner.keys] == [3, 8]
    stats = runner.stats()
    assert stats["replays_by_key"] == {"tokens=3": 1} and stats["lazy"]["misses"] == 1
    runner.run(x=torch.ones(3, 4))
    assert runner.stats()["lazy"]["hits"] == 1
    with pytest.raises(ConfigError, match="cannot grow past"):
        runner.retune([4, 16])


def test_retune_now_captures_at_once():
    runner = GraphRunner(double, phase="decode", inputs=INPUTS, device="cpu", mode="full", sizes=[2, 8])
    runner.capture()
    runner.retune([5, 8], lazy=False)
    assert [k.tokens for k in runner.keys] == [5, 8]
    torch.testing.assert_close(runner.run(x=torch.ones(4, 4)), torch.full((4, 4), 2.0))


# -- the command and the server's --tuned ----------------------------------------------------------------
def test_devgraph_tune_prints_and_writes_the_flag(tmp_path, capsys):
    steps = PhaseSteps("decode", ("tokens",), Counter({(3,): 50, (5,): 40, (33,): 30, (70,): 1}))
    prefill = PhaseSteps("prefill", ("tokens", "requests"), Counter({(100, 3): 5, (40, 1): 9, (300, 7): 2}))
    trace = write_trace(tmp_path / "steps.json", [steps, prefill])
    out, report = tmp_path / "tuned.json", tmp_path / "report.json"
    code = main(
        [
            "tune",
            str(trace),
            "--graphs",
            "3",
            "--axis",
            "requests=2",
            "--out",
            str(out),
            "--report",
            str(report),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    flag = json.loads(captured.out.strip().splitlines()[-1])
    assert flag == json.loads(out.read_text())
    assert flag["decode"] == {"sizes": [5, 33, 70]}
    assert flag["prefill"]["axes"] == {"requests": [3, 7]} and len(flag["prefill"]["sizes"]) == 3
    assert "padded before" in captured.err
    parsed = DeviceGraphConfig.parse(out.read_text())  # the file is a --device-graph-mode value as it is
    assert parsed.for_phase("prefill").axes == (("requests", (3, 7)),)
    detail = json.loads(report.read_text())
    assert detail["phases"]["decode"]["axes"][0]["padded_rows"] == 2 * 50 + 0 + 0 + 0


def test_devgraph_tune_errors_are_one_line(tmp_path, capsys):
    assert main(["tune", str(tmp_path / "nothing.json")]) == 2
    assert "devgraph tune: error: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "x.json", "--graphs", "0"])


def test_serve_tuned_puts_the_sizes_into_the_mode(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text(
        json.dumps({"decode": {"sizes": [3, 9]}, "prefill": {"sizes": [64], "axes": {"requests": [2]}}})
    )
    base = DeviceGraphConfig.parse('{"decode": {"backend": "full", "max_size": 16}, "prefill": "breakable"}')
    merged = apply_tuned(base, path)
    decode, prefill = merged.for_phase("decode"), merged.for_phase("prefill")
    assert (decode.backend, decode.sizes, decode.max_size) == ("full", (3, 9), 16)
    assert (prefill.backend, prefill.sizes, prefill.axes) == ("breakable", (64,), (("requests", (2,)),))
    assert DeviceGraphConfig.parse(merged.source).for_phase("decode").sizes == (3, 9)
    (tmp_path / "bad.json").write_text("decode=full")
    with pytest.raises(ConfigError, match="not a tuned-sizes file"):
        apply_tuned(base, tmp_path / "bad.json")


def two_axis_runner(**kwargs: Any) -> GraphRunner:
    """A prefill runner with a requests axis: token sizes 2 and 16, request buckets 1 and 4."""
    inputs = {"x": StaticInput(torch.float32, (4,)), "lens": StaticInput(torch.int32, axis="requests")}

    def forward(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return x * 2

    config = '{"prefill": {"sizes": [2, 16], "axes": {"requests": [1, 4]}}}'
    return GraphRunner(forward, phase="prefill", inputs=inputs, device="cpu", config=config, **kwargs)


def test_the_flag_axes_key_is_checked_and_cut_at_each_token_size():
    with pytest.raises(ConfigError, match="keys are axis names other than 'tokens'"):
        DeviceGraphConfig.parse('{"prefill": {"axes": {"tokens": [4]}}}')
    with pytest.raises(ConfigError, match="must be an object mapping an axis"):
        DeviceGraphConfig.parse('{"prefill": {"axes": [4]}}')
    runner = two_axis_runner()
    assert runner.schedule.buckets == {2: {"requests": (1, 2)}, 16: {"requests": (1, 4)}}


# -- speed and exactness at scale, hostile files, the stats() export, the wrong file for --tuned ---------
def table_programme(histogram: dict[int, int], graphs: int) -> int:
    """The least padding by the plain O(m^2)-per-round programme over the whole table (the reference)."""
    values = sorted(histogram)
    m = len(values)

    def pad(i: int, j: int) -> int:  # counts i..j padded to values[j]
        return sum(histogram[values[t]] * (values[j] - values[t]) for t in range(i, j + 1))

    cost = [[pad(i, j) if i <= j else None for j in range(m)] for i in range(m)]
    best = [cost[0][j] for j in range(m)]
    least = best[-1]
    for _ in range(min(graphs, m) - 1):
        best = [
            min((best[i] + cost[i + 1][j] for i in range(j) if best[i] is not None), default=None)
            for j in range(m)
        ]
        least = min(least, best[-1])
    return least


@pytest.mark.parametrize("seed", range(4))
def test_the_monotone_programme_equals_the_whole_table(seed):
    rng = random.Random(300 + seed)
    histogram = {rng.randint(1, 4000): rng.randint(1, 200) for _ in range(120)}
    for graphs in (2, 7, 19):
        padded = padding_of(histogram, optimal_sizes(histogram, graphs))[0]
        assert padded == table_programme(histogram, graphs), (seed, graphs)


def test_tune_stays_interactive_on_8192_distinct_counts(tmp_path, capsys):
    # Every prefill count from 1 to 8192, two axes, the default budget (equal graph memory: the size-sum
    # bound binds) and a large --graphs: each well under 10 s on a loaded 2-core machine.
    rng = random.Random(7)
    rows = Counter({(n, rng.randint(1, 8)): rng.randint(1, 40) for n in range(1, 8193)})
    trace = write_trace(tmp_path / "steps.json", [PhaseSteps("prefill", ("tokens", "requests"), rows)])
    for extra in ([], ["--graphs", "64"]):
        start = time.perf_counter()
        assert main(["tune", str(trace), "--report", str(tmp_path / "report.json"), *extra]) == 0
        seconds = time.perf_counter() - start
        axis = json.loads((tmp_path / "report.json").read_text())["phases"]["prefill"]["axes"][0]
        assert axis["exact"] and axis["sizes"][-1] == 8192 and seconds < 10, (extra, seconds, axis)
        if not extra:  # equal graph memory: no more graphs, no larger sum of sizes than the defaults
            assert len(axis["sizes"]) <= 18 and axis["sizes_sum"] <= axis["baseline_sizes_sum"]
    capsys.readouterr()


def _hostile_files(tmp_path):
    head = '{"format": "devgraph-steps", "version": 1, "phases": {"decode": {"steps": [['
    files = {
        "a 5000-digit count": (head + "9" * 5000 + ", 1]]}}}", "more than 4300 digits"),
        "a 4000-digit count": (head + "9" * 4000 + ", 1]]}}}", "count must be an integer from 1 to"),
        "JSON nested 100000 deep": ("[" * 100_000 + "]" * 100_000, "nests"),
        "steps past the cap": (head + "4, " + str(1 << 41) + "]]}}}", "number of steps must be"),
        "a list of lists": ("[[[1]]]", "must be a JSON object (a runner's stats())"),
        "an empty list": ("[]", "holds no recorded steps; record traffic first"),
        "a trace of no phases": (
            '{"format": "devgraph-steps", "version": 1, "phases": {}}',
            "holds no recorded",
        ),
    }
    paths = {}
    for name, (text, needle) in files.items():
        path = tmp_path / f"{len(paths)}.json"
        path.write_text(text)
        paths[name] = (path, needle)
    binary = tmp_path / "latin1.json"
    binary.write_bytes(b'{"format": "devgraph-steps", "caf\xe9": 1}')
    paths["a non-UTF-8 file"] = (binary, "not UTF-8 text (byte 0xe9")
    return paths


def test_every_hostile_trace_is_one_line_naming_the_file(tmp_path, capsys):
    for name, (path, needle) in _hostile_files(tmp_path).items():
        assert main(["tune", str(path)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"devgraph tune: error: {path}"), (name, err)
        assert needle in err[0], (name, err)
    decode = write_trace(tmp_path / "ok.json", [PhaseSteps("decode", ("tokens",), Counter({(3,): 2}))])
    assert main(["tune", str(decode), "--out", str(tmp_path / "no" / "dir.json")]) == 2
    assert "--out" in capsys.readouterr().err
    # An axis the trace never recorded was ignored: the flag printed as if it had been tuned.
    assert main(["tune", str(decode), "--axis", "requets=2"]) == 2
    assert "--axis requets: the recorded decode steps have no such axis" in capsys.readouterr().err


def test_a_two_axis_runners_stats_export_is_read_with_its_axes_sizes_and_bytes():
    runner = two_axis_runner(record_steps=True)
    runner.capture()
    for n, r in ((3, 2), (3, 2), (12, 4)):
        runner.run(x=torch.ones(n, 4), lens=torch.ones(r, dtype=torch.int32))
    exported = json.loads(json.dumps(runner.stats()))
    read = read_steps(exported)["prefill"]
    direct = runner.recorded_steps()
    assert read.axes == direct.axes == ("tokens", "requests")
    assert read.histogram == direct.histogram == Counter({(3, 2): 2, (12, 4): 1})
    assert read.sizes == direct.sizes and read.graph_bytes == direct.graph_bytes
    tuned = tune_phase(read, graphs=2, axis_graphs={"requests": 2})
    assert tuned.axis("tokens").sizes == (3, 12) and tuned.axis("requests").sizes == (2, 4)
    runner.close()


def test_serve_tuned_given_the_wrong_file_names_the_file_and_the_fix(tmp_path, capsys):
    trace = write_trace(tmp_path / "steps.json", [PhaseSteps("decode", ("tokens",), Counter({(3,): 2}))])
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"phase": "decode", "recorded": {"steps": [[3, 2]]}}))
    flags = tmp_path / "flags.json"
    flags.write_text(json.dumps({"decode": {"backend": "full", "sizes": [4]}}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"decode": {"sizes": [0]}}))
    cases = [
        (trace, f"{trace} holds recorded steps, not tuned sizes: run devgraph tune {trace} --out"),
        (stats, "holds recorded steps, not tuned sizes"),
        (flags, "sets backend; a tuned-sizes file holds only sizes"),
        (bad, f"{bad}: "),
        (tmp_path / "missing.json", "cannot read tuned sizes from"),
    ]
    for path, needle in cases:
        assert main(["serve", "--tuned", str(path), "--device", "cpu", "--port", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("devgraph serve: error: "), err
        assert needle in err[0] and "--device-graph-mode" not in err[0].split("sets backend")[0], err
