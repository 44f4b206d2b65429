"""Renamed modules (devgraph/_moved.py): the old import path still gives the module, with a warning that
names the new one; the old file is gone (one name per concept); a mistyped name is still an error."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import devgraph
from devgraph._moved import MOVED

PACKAGE_ROOT = Path(devgraph.__file__).parent.parent


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_name_imports_the_new_module_with_a_warning(
    old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, old, raising=False)  # a first import, as a user's code would do
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new}: import it from there"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    # The module keeps its own spec (the import system set the old name's on it: reload() then re-ran
    # nothing, as it reloads by the spec's name through this finder).
    assert module.__spec__ is not None and module.__spec__.name == new
    assert module.__spec__.origin is not None and module.__spec__.origin.endswith(".py")
    assert not (PACKAGE_ROOT / (old.replace(".", "/") + ".py")).exists(), "the old file is still there"


def test_from_import_of_an_old_name_works_in_a_fresh_process() -> None:
    """What a plug-in written against the old path does: ``from <old> import <name>``, nothing else first."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    from devgraph.strategies.plan import SegmentedPlan\n"
        "except DeprecationWarning as warning:\n"
        "    print(warning)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from devgraph.strategies.plan import SegmentedPlan\n"
        "from devgraph.strategies.segments import SegmentedPlan as Same\n"
        "print(SegmentedPlan is Same)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [
        "devgraph.strategies.plan is now devgraph.strategies.segments: import it from there "
        "(the old name will be removed)",
        "True",
    ]


def test_a_name_that_never_existed_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("devgraph.strategies.plans")
