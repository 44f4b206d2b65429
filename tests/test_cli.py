"""The devgraph command: info and demo, and its one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from devgraph import __version__
from devgraph.cli.info import collect_info
from devgraph.cli.main import build_parser, check_demo_args, main
from devgraph.errors import DevGraphError

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_distribution_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"devgraph {__version__}\n"
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None and declared.group(1) == __version__  # what pip installs is what prints


def test_version_answers_without_importing_torch():
    # The console command's entry point (pyproject's [project.scripts]) answers --version before anything
    # under devgraph (and so torch, seconds of imports) is loaded.
    scripts = re.search(r"^devgraph = \"([^\"]+)\"$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert scripts is not None and scripts.group(1) == "devgraph_launcher:main"
    probe = (
        "import sys; from devgraph_launcher import main; code = main(['--version']); "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'devgraph')); "
        "print(code, loaded)"
    )
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.splitlines() == [f"devgraph {__version__}", "0 []"], result
    assert not re.search(r"\|\s+torch$", result.stderr, re.MULTILINE)  # -X importtime lists every import


def test_a_mistyped_flag_is_reported_by_its_command(capsys):
    cases = [
        (
            ["serve", "--modle", "x"],
            "devgraph serve: error: unrecognized arguments: --modle x (did you mean --model?)",
        ),
        (
            ["tune", "t.json", "--grahps", "3"],
            "devgraph tune: error: unrecognized arguments: --grahps 3 (did you mean --graphs?)",
        ),
        (
            ["bench", "serve", "--concurency=3"],
            "devgraph bench serve: error: unrecognized arguments: --concurency=3 "
            "(did you mean --concurrency?)",
        ),
        (["info", "--jsn"], "devgraph info: error: unrecognized arguments: --jsn (did you mean --json?)"),
        (["serve", "extra"], "devgraph serve: error: unrecognized arguments: extra"),
    ]
    for argv, line in cases:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err == line + "\n"


def test_bare_devgraph_prints_usage_and_exits_2(capsys):
    # argparse's convention for a missing required argument: usage on stderr, exit code 2.
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: devgraph [-h] [--version] COMMAND ...")
    for command in ("info", "demo", "tune", "serve", "bench"):
        assert f"\n    {command} " in captured.err
    assert (
        captured.err.splitlines()[-1]
        == "devgraph: error: a command is required: info, demo, tune, serve or bench"
    )
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: devgraph bench") and "\n    serve " in err
    assert err.splitlines()[-1] == "devgraph bench: error: a command is required: serve"


def test_info_lists_platforms_plugins_and_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"devgraph {__version__} on torch ")
    for name in ("cpu", "cuda", "rocm", "npu"):
        assert f"\n  {name:<8}" in out
    assert "cpu:full" in out and "builtin" in out


def test_info_json_shows_origins_and_reasons(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["devgraph"] == __version__ and info["python"] == ".".join(map(str, sys.version_info[:3]))
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
    assert "decode (breakable): graph vs eager (not timed)" in out and "prefill (tc_piecewise)" in out
    assert "same padded batch: 0\n" in out
    # Simulated graphs make no speed claim; the run says what it does show instead.
    for claim in ("speedup", "eager ms", "graph ms", "eager/graph", "median over"):
        assert claim not in out
    assert "--iters is ignored on the CPU" in out
    assert "What this CPU run shows" in out and "graph output equals eager bit for bit" in out
    assert "No times are shown" in out and "diff n rows: max |graph - eager| on the batch's real rows" in out
    results = json.loads(out_json.read_text())
    rows = [r for phase in results["phases"].values() for r in phase["rows"]]
    assert rows and all(r["max_abs_diff"] == 0 and r["matches"] for r in rows)
    assert all(r["eager_ms"] is None and r["graph_ms"] is None for r in rows)
    assert any(r["key"] is None for r in rows)  # a size past the largest ran eagerly
    assert all(p["stats"]["eager_by_reason"]["past_largest"] >= 1 for p in results["phases"].values())


def test_demo_on_a_device_labels_its_timings_and_fails_on_a_mismatch(capsys):
    """What a GPU run prints (rows with times), checked without a GPU: the timing columns and their
    legend; a row whose graph disagrees with eager makes the demo fail."""
    from devgraph.cli.demo import DemoRow, _conclude, _print_table

    timed = DemoRow("decode", "3 req", "tokens=4", 0.0, 0.0, True, eager_ms=2.0, graph_ms=0.5)
    _print_table("decode (full): median over 20 runs", [timed])
    row = [line for line in capsys.readouterr().out.splitlines() if "3 req" in line][0]
    assert row.split()[-3:] == ["2.000", "0.500", "4.00x"]
    phases = {"decode": {"rows": [asdict(timed)]}}
    assert _conclude(phases, on_cpu=False) == 0
    out = capsys.readouterr().out
    assert "eager/graph: eager time over graph time" in out and "What this CPU run shows" not in out
    wrong = DemoRow("decode", "3 req", "tokens=4", 0.5, 0.5, False)
    assert _conclude({"decode": {"rows": [asdict(wrong)]}}, on_cpu=True) == 1
    out = capsys.readouterr().out
    assert "FAILED: graph output differs from eager beyond the tolerance for decode 3 req" in out
    assert "What this CPU run shows" not in out


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


# -- a missing extra is one line naming the extra to install, found before anything is built --------------
@pytest.fixture
def no_engine(monkeypatch):
    def build_engine(args):
        raise AssertionError("the server started building although it could not serve")

    monkeypatch.setattr("devgraph.serve.api.server.build_engine", build_engine)


@pytest.mark.parametrize(
    ("argv", "prog"),
    [(["serve", "--device", "cpu"], "devgraph serve"), (["bench", "serve"], "devgraph bench serve")],
)
def test_a_command_without_its_extra_says_which_extra_to_install(capsys, monkeypatch, no_engine, argv, prog):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # `import aiohttp` fails as if not installed
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"{prog}: error: this command needs aiohttp, which is not installed: pip install 'devgraph[serve]'\n"
    )


def test_serve_without_aiohttp_is_one_line_for_a_real_user():
    """As a user sees it: a fresh process whose aiohttp is absent (an import hook hides it)."""
    hide = (
        "import importlib.abc, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'aiohttp':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from devgraph.cli import main\n"
        "raise SystemExit(main(['serve', '--device', 'cpu']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == (
        "devgraph serve: error: this command needs aiohttp, which is not installed: "
        "pip install 'devgraph[serve]'\n"
    )


def test_the_metrics_extra_hint_names_the_serve_extra(monkeypatch):
    from devgraph.errors import BackendUnavailableError
    from devgraph.serve.api.metrics import ServeMetrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(BackendUnavailableError, match=r"not installed: pip install 'devgraph\[serve\]'$"):
        ServeMetrics(lambda: {})


# -- serve checks the device as the demo does ----------------------------------------------------------------
def test_serve_on_an_unusable_cuda_says_why_like_the_demo(capsys, no_run, registry, monkeypatch):
    if registry.platform("cuda").availability():
        pytest.skip("CUDA is usable here")
    demo_line = _usage_error(capsys, ["--device", "cuda"])
    monkeypatch.setattr("devgraph.serve.checkpoint.source.ReferenceModel", None)  # nothing may be built
    assert main(["serve", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "AssertionError" not in err[0]
    assert err[0] == demo_line.replace("devgraph demo: error: ", "devgraph serve: error: ")


# -- one error style everywhere: `devgraph <command>: error: <one line>`, exit code 2 ------------------------
@pytest.mark.parametrize(
    ("argv", "prog", "fragment"),
    [
        (["bogus"], "devgraph", "invalid choice: 'bogus'"),
        (["info", "--json=1"], "devgraph info", "ignored explicit argument"),
        (["demo", "--iters", "0"], "devgraph demo", "1 to 100000"),
        (["demo", "--device", "bogus"], "devgraph demo", "is not a torch device"),
        (["serve", "--port", "x"], "devgraph serve", "argument --port"),
        (["serve", "--device", "bogus"], "devgraph serve", "is not a torch device"),
        (["serve", "--token-budget", "2"], "devgraph serve", "--token-budget 2 is below"),
        (["bench", "serve", "--url", "ftp://x"], "devgraph bench serve", "is not an http:// or https:// URL"),
        (
            ["bench", "serve", "--url", "http://127.0.0.1:9"],
            "devgraph bench serve",
            "cannot reach the server",
        ),
    ],
)
def test_every_command_fails_in_one_style(capsys, argv, prog, fragment):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{prog}: error: ") and fragment in lines[0], lines[0]


def test_python_m_devgraph_serve_is_devgraph_serve():
    proc = subprocess.run(
        [sys.executable, "-m", "devgraph.serve", "--port", "x"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("devgraph serve: error: argument --port: ") and proc.stderr.count("\n") == 1
