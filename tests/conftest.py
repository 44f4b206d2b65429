"""Shared fixtures and hardware markers for the devgraph suite."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from devgraph import graph_break
from devgraph.reference import ReferenceConfig, ReferenceModel
from devgraph.registry.plugins import get_registry


def _cuda_reason() -> str | None:
    if getattr(torch.version, "hip", None):
        return "torch is a ROCm build"
    if not torch.cuda.is_available():
        return "no NVIDIA GPU (torch.cuda.is_available() is False)"
    return None


def _rocm_reason() -> str | None:
    if not getattr(torch.version, "hip", None):
        return "torch is not a ROCm build (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return "no AMD GPU visible"
    return None


def _npu_reason() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch-npu is not installed (install devgraph-npu[ascend] on an Ascend machine)"
    return None


def _multi_gpu_reason() -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs two or more GPUs"
    return None


_HARDWARE = {"cuda": _cuda_reason, "rocm": _rocm_reason, "npu": _npu_reason, "multi_gpu": _multi_gpu_reason}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons = {name: check() for name, check in _HARDWARE.items()}
    for item in items:
        for name, reason in reasons.items():
            if reason is not None and name in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{name}: {reason}"))


@pytest.fixture(scope="session")
def registry():
    """The process-wide plug-in registry (loaded once)."""
    return get_registry()


@pytest.fixture(scope="session")
def tiny_config() -> ReferenceConfig:
    return ReferenceConfig.preset("tiny")


@pytest.fixture
def tiny_model(tiny_config: ReferenceConfig) -> Iterator[ReferenceModel]:
    """A fresh tiny reference model on the CPU with a random KV-cache history."""
    torch.manual_seed(0)
    model = ReferenceModel(tiny_config, device="cpu", seed=0)
    model.randomize_cache(seed=0)
    yield model


@dataclass(frozen=True)
class HFCase:
    """A tiny local checkpoint of one family, the prompt set in its tokenizer's ids, and transformers'
    greedy continuation of each prompt (the oracle)."""

    family: str
    directory: Path
    prompts: list[list[int]]
    expected: list  # checkpoints.Greedy per prompt


@pytest.fixture(scope="session")
def hf_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HFCase]:
    """One checkpoint per served family (Llama, Qwen2, Qwen3, Mistral), built here with transformers and
    tokenizers (nothing downloaded), and transformers' greedy tokens for the prompt set."""
    for module in ("transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module, reason=f"serving a checkpoint needs {module}")
    from checkpoints import FAMILIES, PROMPTS, build_checkpoint, hf_greedy

    root = tmp_path_factory.mktemp("checkpoints")
    cases = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for family in FAMILIES:
            directory = build_checkpoint(root / family, family)
            tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(directory)
            prompts = [tokenizer.encode(text) for text in PROMPTS]
            cases[family] = HFCase(family, directory, prompts, hf_greedy(directory, prompts))
    finally:
        torch.set_num_threads(threads)
    return cases


@pytest.fixture(scope="session")
def tool_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints with real instruct models' chat templates (Qwen2.5's Hermes tool calls, Llama
    3.1's JSON ones): ``{"qwen2.5": dir, "llama3.1": dir}`` (see tests/tool_checkpoints.py)."""
    for module in ("transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module, reason=f"serving a checkpoint needs {module}")
    from tool_checkpoints import build_tool_checkpoint

    root = tmp_path_factory.mktemp("tool_checkpoints")
    return {family: build_tool_checkpoint(root / family, family) for family in ("qwen2.5", "llama3.1")}


def write_distribution(root, dist_name: str, modules: dict[str, str], entry_points: dict[str, str]) -> None:
    """Install a distribution the way pip lays it out: modules plus ``*.dist-info`` with entry points.

    ``root`` goes on ``sys.path`` (the caller does that), so ``importlib.metadata`` finds it for real.
    """
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[devgraph]\n{lines}\n")
    (info / "RECORD").write_text("")


@pytest.fixture
def dist_dir(tmp_path, monkeypatch):
    """A site directory on sys.path for distributions a test installs with :func:`write_distribution`."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


# Break ops for the tests of break-op memory shared across sizes (tests/test_strategies.py, test_cuda.py).
@graph_break("devgraph_test::mix_rows")
def mix_rows(x: torch.Tensor) -> torch.Tensor:
    """Every output row depends on every row before it, so a row read from another size's memory shows."""
    return torch.cumsum(x, dim=0) * 0.5 + x


@graph_break("devgraph_test::shift_rows")
def shift_rows(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Row i gets row i - 1 (row 0 gets zeros): real rows never read the padding rows after them."""
    return torch.cat([torch.zeros_like(x[:1]), x[:-1]]) - bias


@graph_break("devgraph_test::host_read_at_four")
def host_read_at_four(x: torch.Tensor) -> torch.Tensor:
    """Reads a value on the host for 4-row batches: fine eagerly (between segments), not inside a graph
    (``full`` cannot capture the key of 4 rows; a fallback graph set can: tests/test_fallback.py,
    tests/test_life.py)."""
    if x.shape[0] == 4:
        return x * float(x.abs().sum().item() >= 0)
    return x * 1.0


def chained_breaks(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Two break ops back to back (the second reads the first's output, a weak alias into the graph pool
    on a device), then a segment."""
    return torch.tanh(shift_rows(mix_rows(x * 1.5), bias)) + x


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a module: tiny matrices on a shared 2-core machine only contend for OpenMP
    threads (steps measured 20x slower). Use with ``pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_under_triton_interpreter() -> Callable[[str], str]:
    """Runs a script in a child process under ``TRITON_INTERPRET=1`` (Triton reads it when its kernels are
    defined, so not in this process) with ``tests/`` importable; returns its output, failing the test
    with the child's output when it exits non-zero."""

    def run(script: str) -> str:
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([here, *sys.path])}
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    return run
