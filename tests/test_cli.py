"""The devgraph command: info and demo, and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from devgraph.cli import main


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
    assert any(r["size"] is None for r in rows)  # a size past the largest ran eagerly


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
