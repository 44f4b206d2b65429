"""The devgraph command: info and demo, and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from devgraph.cli.info import collect_info
from devgraph.cli.main import build_parser, check_demo_args, main
from devgraph.errors import DevGraphError


def test_info_lists_platforms_plugins_and_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu", "cuda", "rocm", "npu"):
        assert f"\n  {name:<8}" in out
    assert "cpu:full" in out and "builtin" in out


def test_info_json_shows_origins_and_reasons(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    platforms = {p["name"]: p for p in info["platforms"]}
    assert platforms["cpu"]["usable"]
    assert platforms["cuda"]["origin"].startswith("devgraph-cuda")
    if not platforms["cuda"]["usable"]:
        assert platforms["cuda"]["reason"]


def test_demo_prints_tables_with_zero_difference(capsys, tmp_path):
    out_json = tmp_path / "demo.json"
    code = main(
        [
            "demo",
            "--device-graph-mode",
            "decode=breakable,prefill=tc_piecewise",
            "--decode-sizes",
            "1,4",
            "--prefill-sizes",
            "16,32",
            "--iters",
            "1",
            "--json",
            str(out_json),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "decode (breakable)" in out and "prefill (tc_piecewise)" in out
    assert "same padded batch: 0\n" in out
    results = json.loads(out_json.read_text())
    rows = [r for phase in results["phases"].values() for r in phase["rows"]]
    assert rows and all(r["max_abs_diff"] == 0 for r in rows)
    assert any(r["key"] is None for r in rows)  # a size past the largest ran eagerly
    assert all(p["stats"]["eager_by_reason"]["past_largest"] >= 1 for p in results["phases"].values())


@pytest.mark.parametrize("mode", ['{"decode": "ful"}', "{decode", "decode=fast"])
def test_demo_bad_mode_is_one_line_no_traceback(mode):
    proc = subprocess.run(
        [sys.executable, "-m", "devgraph", "demo", "--device-graph-mode", mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert mode in lines[0] and "accepted" in lines[0]


def test_bad_argument_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--decode-sizes", "a,b"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "comma-separated" in err[0]


# -- every bad demo argument: one usage line, exit code 2, found before the run ----------------------------
@pytest.fixture
def no_run(monkeypatch):
    """The demo must not start: every check happens before it."""

    def run_demo(args):
        raise AssertionError("the demo ran although an argument was bad")

    monkeypatch.setattr("devgraph.cli.demo.run_demo", run_demo)


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("devgraph demo: error: ")
    return lines[0]


def test_demo_on_an_unusable_cuda(capsys, no_run, registry):
    if registry.platform("cuda").availability():
        pytest.skip("CUDA is usable here")
    line = _usage_error(capsys, ["--device", "cuda"])
    reason = next(p for p in collect_info(registry)["platforms"] if p["name"] == "cuda")["reason"]
    assert "platform 'cuda' is unusable here" in line and reason in line


def test_demo_on_a_bogus_device(capsys, no_run):
    line = _usage_error(capsys, ["--device", "bogus"])
    assert "'bogus' is not a torch device" in line and "cpu" in line


def test_demo_on_npu_without_torch_npu_gives_the_install_hint(capsys, no_run, registry):
    if registry.platform("npu").availability():
        pytest.skip("torch-npu is usable here")
    line = _usage_error(capsys, ["--device", "npu"])
    reason = next(p for p in collect_info(registry)["platforms"] if p["name"] == "npu")["reason"]
    assert "platform 'npu' is unusable here" in line and reason in line


@pytest.mark.parametrize("iters", ["-1", "0", "1000001", "x"])
def test_demo_iters_must_be_positive(capsys, no_run, iters):
    line = _usage_error(capsys, ["--iters", iters])
    assert "argument --iters" in line and "1 to 100000" in line


@pytest.mark.parametrize("seed", [str(2**63), "-1", "9" * 5000])
def test_demo_seed_must_fit_a_64_bit_seed(capsys, no_run, seed):
    line = _usage_error(capsys, ["--seed", seed])
    assert "argument --seed" in line and "0 to 9223372036854775807" in line and len(line) < 300


def test_demo_json_path_is_checked_before_the_run(capsys, no_run, tmp_path):
    line = _usage_error(capsys, ["--json", str(tmp_path / "missing" / "out.json")])
    assert "does not exist" in line
    line = _usage_error(capsys, ["--json", str(tmp_path)])
    assert "is a directory" in line


def test_demo_mode_garbage(capsys, no_run):
    line = _usage_error(capsys, ["--device-graph-mode", "garbage"])
    assert "argument --device-graph-mode" in line and "mode 'garbage' is not valid; accepted:" in line


def test_demo_sizes_are_bounded(capsys, no_run):
    line = _usage_error(capsys, ["--decode-sizes", "1,1000000000"])
    assert "hard cap" in line


def test_check_demo_args_for_namespaces_built_in_code(tmp_path):
    good = build_parser().parse_args(["demo", "--json", str(tmp_path / "out.json")])
    check_demo_args(good)
    for field, value, fragment in [
        ("iters", -1, "--iters must be an integer from 1"),
        ("seed", 2**64, "--seed must be an integer from 0"),
        ("device_graph_mode", "decode=fast", "mode 'fast' is not valid"),
        ("device", "bogus", "is not a torch device"),
        ("decode_sizes", [0], "--decode-sizes entry must be an integer"),
    ]:
        args = build_parser().parse_args(["demo"])
        setattr(args, field, value)
        with pytest.raises(DevGraphError, match=fragment):
            check_demo_args(args)


# -- the conformance kit's pytest option ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("garbage", "'garbage': expected PLATFORM:NAME"),
        ("cpu:full:extra", "expected PLATFORM:NAME"),
        ("cpu:warp", "'cpu:warp' is not a registered backend"),
    ],
)
def test_pytest_devgraph_backend_garbage_is_a_usage_error(tmp_path, target, fragment):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--devgraph-backend", target],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 4, output  # pytest's usage-error exit code
    assert "INTERNALERROR" not in output and "Traceback" not in output
    assert fragment in output and "registered targets: " in output and "cpu:full" in output
