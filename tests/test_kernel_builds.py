"""Building the reference decoder's Triton kernels ahead (``devgraph.reference.kernel_builds``) and the
build-or-launch switch under every reference Triton launch (``devgraph.reference.kernels.launching``).

CPU: the switch with stand-in kernels; and, under ``TRITON_INTERPRET=1`` in a child process, every launch
of real decode steps (batches of 1 and 3, a Qwen3-like layer with q/k norms and a q/k/v bias) compared
with what the build passes to Triton, argument by argument as Triton specialises a kernel (dtypes,
16-byte alignment, integers equal to 1 or divisible by 16 unless the kernel opts out, every compile-time
value): a build from other arguments would be a different kernel than the launch. GPU: after the model's
set-up thread, eager decode steps of several sizes compile no Triton kernel.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import pytest
import torch

from devgraph.reference import ReferenceConfig
from devgraph.reference.kernel_builds import DecodeShapes
from devgraph.reference.kernels.launching import build_only, building, launch, on_device

HAS_TRITON = importlib.util.find_spec("triton") is not None


class _Kernel:
    def __init__(self) -> None:
        self.launched: list[tuple[Any, ...]] = []
        self.built: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **options: self.launched.append((grid, args, options))

    def warmup(self, *args: Any, grid: tuple[int, ...], **options: Any) -> None:
        self.built.append((grid, args, options))


def test_a_launch_runs_the_kernel_and_inside_build_only_builds_it_instead() -> None:
    kernel = _Kernel()
    launch(kernel, (3,), 1, 2, BLOCK=16)
    with build_only():
        assert building()
        launch(kernel, (4,), 5, BLOCK=32)
    assert not building()
    assert kernel.launched == [((3,), (1, 2), {"BLOCK": 16})]
    assert kernel.built == [((4,), (5,), {"BLOCK": 32})]


def test_build_only_holds_for_its_own_thread_only_and_nests() -> None:
    seen: list[bool] = []
    with build_only():
        worker = threading.Thread(target=lambda: seen.append(building()))
        worker.start()
        worker.join()
        with build_only():
            pass
        assert building()  # the inner block ends without switching the outer one off
    assert seen == [False]
    assert not building()


def test_meta_tensors_pass_for_device_ones_only_while_building() -> None:
    meta = torch.empty(2, device="meta")
    assert not on_device(meta) and not on_device(torch.empty(2))
    with build_only():
        assert on_device(meta) and not on_device(torch.empty(2))


def test_the_shapes_follow_the_config_and_its_tensor_parallel_share() -> None:
    config = ReferenceConfig.preset("tiny", qk_norm=True, qkv_bias=True)
    whole, half = DecodeShapes.of(config), DecodeShapes.of(config, shards=2)
    assert (whole.heads, whole.kv_heads, whole.intermediate) == (
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
    )
    assert (half.heads, half.intermediate, half.vocab) == (
        config.num_heads // 2,
        config.intermediate_size // 2,
        config.vocab_size // 2,
    )
    assert whole.qk_norm and whole.qkv_bias and whole.max_blocks == config.max_blocks_per_request


def test_the_set_up_thread_builds_the_decode_kernels_and_records_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devgraph.reference import fused

    calls: list[tuple[DecodeShapes, str]] = []

    class _Builds:
        def build_silu_mul(self, width: int, dtype: torch.dtype) -> None:
            pass

        def build_linear(self, dtype: torch.dtype, has_bias: bool = False) -> None:
            pass

    def build(shapes: DecodeShapes, device: torch.device) -> None:
        calls.append((shapes, threading.current_thread().name))
        raise RuntimeError("ptxas is missing")

    shapes = DecodeShapes.of(ReferenceConfig.preset("tiny"))
    monkeypatch.setattr(fused, "TRITON_SET_UP", {})
    monkeypatch.setattr(fused, "_ops", _Builds)
    monkeypatch.setattr(fused, "_linear_ops", _Builds)
    monkeypatch.setattr(fused, "build_decode_kernels", build)
    thread = fused.set_up_triton("triton", torch.device("cuda"), 64, torch.float16, decode=shapes)
    assert thread is not None
    thread.join(10)
    assert calls == [(shapes, "devgraph-triton-set-up")]
    assert "ptxas is missing" in str(fused.TRITON_SET_UP["error"])
    assert "decode_kernels" not in fused.TRITON_SET_UP and "set_up_seconds" in fused.TRITON_SET_UP


def test_the_set_up_thread_builds_for_its_model_s_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # The current device is per thread, and Triton keeps a kernel per device: a tensor-parallel rank's
    # model on cuda:1 must have its kernels built for cuda:1, not for the thread's default cuda:0.
    from devgraph.reference import fused

    chosen: list[tuple[torch.device, str]] = []

    class _Builds:
        def build_silu_mul(self, width: int, dtype: torch.dtype) -> None:
            pass

        def build_linear(self, dtype: torch.dtype, has_bias: bool = False) -> None:
            pass

    monkeypatch.setattr(fused, "TRITON_SET_UP", {})
    monkeypatch.setattr(fused, "_ops", _Builds)
    monkeypatch.setattr(fused, "_linear_ops", _Builds)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: chosen.append((d, threading.current_thread().name))
    )
    thread = fused.set_up_triton("triton", torch.device("cuda", 1), 64, torch.float16)
    assert thread is not None
    thread.join(10)
    assert chosen == [(1, "devgraph-triton-set-up")], chosen
    assert "error" not in fused.TRITON_SET_UP
    # a bare "cuda": the device current on the caller's thread, not the new thread's default
    monkeypatch.setattr(fused, "TRITON_SET_UP", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    thread = fused.set_up_triton("triton", torch.device("cuda"), 64, torch.float16)
    assert thread is not None
    thread.join(10)
    assert chosen[-1] == (2, "devgraph-triton-set-up"), chosen


_SCRIPT = """
import torch
from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch
from devgraph.reference.kernel_builds import DecodeShapes, build_decode_kernels
from devgraph.reference.kernels import launching, triton_argmax, triton_fused, triton_linear, triton_ops

def key(kernel, grid, args, options):
    names = kernel.arg_names
    free = set((getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or ())
    parts = []
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            parts.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or value is None:
            parts.append((name, value))
        elif isinstance(value, int):
            parts.append((name, "int") if name in free else (name, value == 1, value % 16 == 0))
        elif isinstance(value, float):
            parts.append((name, "float"))
        else:
            parts.append((name, repr(value)))
    return (kernel.fn.__name__, tuple(parts), tuple(sorted(options.items())))

seen, devices = [], set()
original = launching.launch

def record(kernel, grid, *args, **options):
    seen.append(key(kernel, grid, args, options))
    devices.update(a.device.type for a in args if isinstance(a, torch.Tensor))
    if not launching.building():
        original(kernel, grid, *args, **options)

for module in (triton_argmax, triton_fused, triton_linear, triton_ops):
    module.launch = record
config = ReferenceConfig.preset("tiny", max_requests=4, dtype=torch.float16, qk_norm=True, qkv_bias=True,
                                tie_embeddings=False, kernels="triton")
model = ReferenceModel(config, seed=0)
for batch in (1, 3):
    model.decode_step_with_greedy(**make_decode_batch(model, batch, seed=batch))
launched, seen[:] = set(seen), []
assert devices == {"cpu"}, devices
devices.clear()
build_decode_kernels(DecodeShapes.of(config), torch.device("cpu"), rows=[1, 3])
built = set(seen)
assert devices == {"meta"}, devices  # the build holds no memory
names = sorted({k[0] for k in launched})
expected = {"decode_split_kernel", "write_kv_kernel", "_rms_norm_kernel", "_qk_norm_rope_kernel",
            "_chunk_best_kernel", "_row_best_kernel"}
assert expected <= set(names), names
missing = launched - built
assert not missing, "launched but not built: " + repr(sorted(missing))
print("kernels", len(launched), "built", len(built), names)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the kernels are Triton)")
def test_the_build_passes_what_decode_steps_launch_with(run_under_triton_interpreter: Any) -> None:
    output = run_under_triton_interpreter(_SCRIPT)
    assert "kernels" in output


_GPU_SCRIPT = """
import threading, time
import torch
from triton.runtime.jit import JITFunction
from devgraph.reference import ReferenceConfig, ReferenceModel, make_decode_batch
from devgraph.reference import fused

compiled = []
original = JITFunction._do_compile

def counted(self, *args, **kwargs):
    compiled.append((self.fn.__name__, threading.current_thread().name))
    return original(self, *args, **kwargs)

JITFunction._do_compile = counted
config = ReferenceConfig.preset(
    "tiny", max_requests=24, dtype=torch.bfloat16, qk_norm=True, qkv_bias=True, kernels="triton"
)
model = ReferenceModel(config, device="cuda", seed=0)
deadline = time.monotonic() + 300
while "seconds" not in fused.TRITON_SET_UP and time.monotonic() < deadline:
    time.sleep(0.05)
state = fused.TRITON_SET_UP
assert "error" not in state and state.get("decode_kernels"), state
built = len(compiled)
assert built >= 8, compiled  # an empty cache: the set-up compiled the step's kernels itself
for batch in (1, 2, 5, 16, 24):
    batch_inputs = {k: v.cuda() for k, v in make_decode_batch(model, batch, seed=batch).items()}
    model.decode_step_with_greedy(**batch_inputs)
torch.cuda.synchronize()
assert compiled[built:] == [], compiled[built:]
print("built", built)
"""


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_on_a_gpu_decode_steps_after_the_set_up_compile_no_kernel(tmp_path: Any) -> None:
    # A fresh process with an empty Triton cache: the set-up thread compiles, the steps after it compile
    # nothing (in this process, earlier tests could have built the kernels already and prove nothing).
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "built" in done.stdout


def test_the_projections_are_built_for_every_row_count_powers_of_two_first() -> None:
    from devgraph.reference.kernel_builds import _rows_in_build_order

    order = _rows_in_build_order(16)
    assert sorted(order) == list(range(1, 17))
    assert order[:5] == [1, 2, 4, 8, 16]
    assert _rows_in_build_order(1) == [1]
