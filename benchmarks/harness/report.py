"""What a benchmark writes: the JSON report (the environment and the command; saved after every section,
so a crash keeps what was measured), where it goes, and output differences."""

from __future__ import annotations

import json
import logging
import os
import platform as host_platform
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from harness.device import Device

__all__ = ["Report", "command_line", "diff", "environment", "output_path"]

log = logging.getLogger("bench")


def diff(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max |out - ref| and the relative L2 error."""
    a, b = out.detach().double(), ref.detach().double()
    if a.shape != b.shape:
        return {"max_abs": float("nan"), "rel_l2": float("nan")}
    return {
        "max_abs": float((a - b).abs().max().item()) if a.numel() else 0.0,
        "rel_l2": float((a - b).norm().item() / max(b.norm().item(), 1e-30)),
    }


def command_line() -> str:
    return " ".join(["python", *map(shlex.quote, sys.argv)])


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def environment(dev: Device) -> dict[str, Any]:
    import devgraph

    return {
        "device": dev.name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "python": host_platform.python_version(),
        "devgraph": devgraph.__version__,
        "command": command_line(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def output_path(name: str, default: str, given: str | None, smoke: bool) -> Path:
    """``given``, else ``$OUT/name``, else ``default`` (``--smoke`` writes to a temporary folder instead)."""
    if given:
        return Path(given)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / name
    if smoke:
        import tempfile

        return Path(tempfile.gettempdir()) / f"devgraph-smoke-{name}"
    return Path(default)


class Report:
    """The JSON being built: written after every section, so a crash keeps what was measured."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "errors": []}

    def error(self, what: str, exc: BaseException) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.data["errors"].append(f"{what}: {type(exc).__name__}: {first}"[:2000])
        log.error("%s failed:\n%s", what, "".join(traceback.format_exception(exc))[-4000:])

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
