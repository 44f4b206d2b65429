#!/usr/bin/env python3
"""Hugging Face ``generate()``: HF eager, HF compiled, and devgraph's DevgraphDecoder, in one process.

Model: ``Qwen3ForCausalLM`` shaped like Qwen3-0.6B (28 layers, hidden 1024, 16 query / 8 key-value heads of
128, vocab 151936), random bf16 weights, built from a config (no download). Prompts: random tokens,
``--prompt-len`` each, batch 1 and 8; ``--new-tokens`` new tokens; static cache of ``--max-cache-len``.

Variants, in this order (HF's compiled ``generate()`` records CUDA graph trees, which free cuBLAS workspaces
that graphs captured earlier may use, see benchmarks/cublas_workspace_hazard.py, so it runs before devgraph
captures anything):

* ``hf_eager``: ``generate(cache_implementation="static", disable_compile=True)``; cuDNN SDPA off (with it
  HF eager is not reproducible run to run on an H100). Its tokens are the reference.
* ``hf_compiled``: ``generate(cache_implementation="static")``, which compiles its decode step on a GPU
  (inductor, ``reduce-overhead``); cuDNN SDPA on (torch's default).
* ``devgraph_exact``: ``DevgraphDecoder(model, sizes=(1, 8))``: HF's own kernels in one CUDA graph per batch
  size; cuDNN SDPA off, so its tokens can be compared bitwise with ``hf_eager`` (also on a left-padded
  batch of 5 replayed at size 8).
* ``devgraph_fast``: ``fast=True`` (compiled RMSNorm / SwiGLU / RoPE regions, packed GQA); cuDNN on.
* ``devgraph_fast_windows``: ``fast=FastPath(windows="auto")``: also graphs per cache window (256, 512,
  1024, 2048), attention reads only the window holding the sequence; cuDNN on.

Per-token latency: a logits processor records a CUDA event at every decode step (HF calls the processors
once per generated token, after the step's forward, in its loop and in devgraph's); the latency is the
median of the intervals between consecutive events of one ``generate()`` (prefill excluded: the first event
follows it), then the median over ``--repeats`` calls. Intervals include the host work between steps.
Warm-up: HF compiled = t(first call) - t(fastest later call); devgraph = decoder construction (cache,
capture, compiles) + t(first call) - t(fastest later call). Variants that compile do so in a fresh inductor
and Triton cache directory (cold, as on a new machine). Token identity: the first differing column
against ``hf_eager``.

    python benchmarks/bench_hf.py --gpu          # $OUT/hf.json (+ .png), else benchmarks/results/h100-hf.json
    python benchmarks/bench_hf.py --smoke        # the same pipeline on the CPU: tiny model, simulated graphs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hf_measure import first_difference, plot, step_clock, sync, table, targets

from devgraph.integrations.transformers import DevgraphDecoder, FastPath

QWEN3_06B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY = {**QWEN3_06B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
ISSUE_RECORD = {
    "hf_compiled_per_token_ms": {"1": 3.39, "8": 4.91},
    "hf_compiled_warmup_s": {"1": 43, "8": 62},
}
PAD = 0
#: Variants that compile: each runs in a fresh inductor/Triton cache (warm-up as on a new machine).
COMPILING = ("hf_compiled", "devgraph_fast", "devgraph_fast_windows")


def build_model(shape: dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    import transformers as tf

    config = tf.Qwen3Config(pad_token_id=PAD, bos_token_id=1, eos_token_id=None, **shape)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = tf.Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def fresh_compile_cache() -> Any:
    """A fresh inductor and Triton cache for one variant, so its compile is as cold as on a new machine."""
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # torch < 2.9
        from torch._inductor.utils import fresh_inductor_cache as fresh_cache
    return fresh_cache()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()
        self.device = torch.device("cuda" if args.gpu else "cpu")
        self.model = build_model(QWEN3_06B if args.gpu else TINY, self.device.type, args.dtype)
        vocab = self.model.config.vocab_size
        generator = torch.Generator(device=self.device).manual_seed(1)
        self.prompts = {
            b: torch.randint(3, vocab, (b, args.prompt_len), device=self.device, generator=generator)
            for b in args.batches
        }
        self.reference: dict[int, torch.Tensor] = {}
        self.out: dict[str, Any] = {"per_token_ms": {}, "warmup_s": {}, "tokens_equal_hf_eager": {}}
        self.out["step_ms_spread"] = {}
        self.out["generate_s"] = {}
        self.out["errors"] = {}

    def left(self) -> float:
        return self.args.time_budget - (time.perf_counter() - self.start)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        sync(self.device)
        t0 = time.perf_counter()
        result = fn()
        sync(self.device)
        return time.perf_counter() - t0, result

    def generate(self, fn: Callable[..., Any], batch: int, **kwargs: Any) -> tuple[float, torch.Tensor, list]:
        clock = step_clock(self.device)
        seconds, tokens = self.timed(
            lambda: fn(
                self.prompts[batch],
                max_new_tokens=self.args.new_tokens,
                do_sample=False,
                pad_token_id=PAD,
                logits_processor=[clock],
                **kwargs,
            )
        )
        return seconds, tokens, clock.step_ms()

    def record(
        self, name: str, batch: int, calls: list[list[float]], tokens: torch.Tensor, seconds: list[float]
    ) -> None:
        self.out["generate_s"].setdefault(name, {})[str(batch)] = round(statistics.median(seconds), 4)
        medians = [statistics.median(steps) for steps in calls if steps]
        self.out["per_token_ms"].setdefault(name, {})[str(batch)] = round(statistics.median(medians), 3)
        every = [ms for steps in calls for ms in steps]
        spread = {"p10": round(statistics.quantiles(every, n=10)[0], 3), "max": round(max(every), 3)}
        self.out["step_ms_spread"].setdefault(name, {})[str(batch)] = {**spread, "calls": len(calls)}
        if name != "hf_eager":
            self.out["tokens_equal_hf_eager"].setdefault(name, {})[str(batch)] = first_difference(
                tokens, self.reference[batch]
            )

    # -- variants ---------------------------------------------------------------------------------------
    def hf_eager(self) -> None:
        torch.backends.cuda.enable_cudnn_sdp(False)
        run = self.hf_static(disable_compile=True)
        for b in self.args.batches:
            seconds, self.reference[b], steps = self.generate(run, b)
            self.record("hf_eager", b, [steps], self.reference[b], [seconds])

    def hf_static(self, **extra: Any) -> Callable[..., Any]:
        def run(ids: torch.Tensor, **kwargs: Any) -> Any:
            return self.model.generate(
                ids, cache_implementation="static", max_cache_len=self.args.max_cache_len, **extra, **kwargs
            )

        return run

    def hf_compiled(self) -> None:
        torch.backends.cuda.enable_cudnn_sdp(True)
        run = self.hf_static()
        for b in self.args.batches:
            if self.left() < self.args.hf_compile_reserve:
                self.out["errors"][f"hf_compiled/{b}"] = (
                    f"skipped: {self.left():.0f} s of the time budget left"
                )
                continue
            first, _, _ = self.generate(run, b)
            calls, again, tokens = [], [], None
            for _ in range(self.args.repeats):
                seconds, tokens, steps = self.generate(run, b)
                again.append(seconds)
                calls.append(steps)
            self.out["warmup_s"].setdefault("hf_compiled", {})[str(b)] = round(first - min(again), 2)
            assert tokens is not None
            self.record("hf_compiled", b, calls, tokens, again)

    def devgraph(self, name: str, fast: bool | FastPath, cudnn: bool) -> None:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        sizes = tuple(sorted(self.args.batches))
        build_s, decoder = self.timed(
            lambda: DevgraphDecoder(self.model, sizes=sizes, max_cache_len=self.args.max_cache_len, fast=fast)
        )
        try:
            extra = 0.0
            for b in self.args.batches:
                first, _, _ = self.generate(decoder.generate, b)
                calls, again, tokens = [], [], None
                for _ in range(self.args.repeats):
                    seconds, tokens, steps = self.generate(decoder.generate, b)
                    again.append(seconds)
                    calls.append(steps)
                extra += max(0.0, first - min(again))
                assert tokens is not None
                self.record(name, b, calls, tokens, again)
            self.out["warmup_s"][name] = {
                "total": round(build_s + extra, 2),
                "build_and_capture": round(build_s, 2),
                "first_call_extra": round(extra, 2),
            }
            if name == "devgraph_exact":
                try:
                    self.padded_check(decoder)
                except Exception as exc:
                    self.out["errors"]["padded_check"] = f"{type(exc).__name__}: {exc}"[:1000]
            info = decoder.inspect()
            self.out.setdefault("devgraph", {})[name] = {
                "capture": decoder.runner.report.table() if decoder.runner.report else None,
                "fast": info["fast"],
                "windows": info["windows"],
                "stats": {k: v for k, v in decoder.stats().items() if k != "runner"},
                "replays_by_key": decoder.stats()["runner"]["replays_by_key"],
            }
        finally:
            decoder.close()

    def padded_check(self, decoder: Any) -> None:
        """Left-padded prompts of different lengths (5 of them at batch 8), replayed at the largest size,
        against HF eager on the same prompts."""
        largest = max(self.args.batches)
        rows, step = max(2, largest * 5 // 8), max(1, self.args.prompt_len // 16)
        lengths = [self.args.prompt_len - step * i for i in range(rows)]
        ids = torch.full((rows, max(lengths)), PAD, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for row, length in enumerate(lengths):
            ids[row, -length:] = self.prompts[largest][row, :length]
            mask[row, -length:] = 1
        kwargs = {"attention_mask": mask, "max_new_tokens": 32, "do_sample": False, "pad_token_id": PAD}
        expected = self.hf_static(disable_compile=True)(ids, **kwargs)
        got = decoder.generate(ids, **kwargs)
        same = self.out["tokens_equal_hf_eager"]["devgraph_exact"]
        same[f"padded_{rows}_in_{largest}"] = first_difference(got, expected)

    def run(self) -> dict[str, Any]:
        variants: list[tuple[str, Callable[[], None]]] = [("hf_eager", self.hf_eager)]
        if self.args.gpu and not self.args.skip_hf_compiled:
            variants.append(("hf_compiled", self.hf_compiled))
        compiler = "inductor" if self.args.gpu else "eager"
        windows = "auto" if self.args.gpu else (32,)
        variants += [
            ("devgraph_exact", lambda: self.devgraph("devgraph_exact", False, cudnn=False)),
            (
                "devgraph_fast",
                lambda: self.devgraph("devgraph_fast", FastPath(compiler=compiler), cudnn=True),
            ),
            (
                "devgraph_fast_windows",
                lambda: self.devgraph(
                    "devgraph_fast_windows", FastPath(compiler=compiler, windows=windows), cudnn=True
                ),
            ),
        ]
        with torch.no_grad():
            for name, variant in variants:
                if name != "hf_eager" and self.left() < 20:
                    self.out["errors"][name] = f"skipped: {self.left():.0f} s of the time budget left"
                    continue
                t0 = time.perf_counter()
                cold = fresh_compile_cache() if name in COMPILING else contextlib.nullcontext()
                try:
                    with cold:
                        variant()
                except Exception as exc:  # keep what was measured so far
                    self.out["errors"][name] = f"{type(exc).__name__}: {exc}"[:1000]
                    if name == "hf_eager":
                        raise
                self.out.setdefault("variant_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        torch.backends.cuda.enable_cudnn_sdp(True)
        self.out["targets"] = targets(self.out, self.args.batches)
        self.out["total_seconds"] = round(time.perf_counter() - self.start, 1)
        return self.out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", action="store_true", help="Qwen3-0.6B shape, bf16, on CUDA")
    where.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (simulated graphs)")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--max-cache-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2, help="timed generate() calls per variant and batch")
    parser.add_argument("--skip-hf-compiled", action="store_true")
    parser.add_argument(
        "--time-budget", type=float, default=290.0, help="seconds; later variants are skipped"
    )
    parser.add_argument("--hf-compile-reserve", type=float, default=110.0, help="seconds a compile may need")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    gpu_defaults = {"batches": [1, 8], "prompt_len": 128, "new_tokens": 144, "max_cache_len": 2048}
    smoke_defaults = {"batches": [1, 4], "prompt_len": 8, "new_tokens": 12, "max_cache_len": 64}
    for key, value in (gpu_defaults if args.gpu else smoke_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = torch.bfloat16 if args.gpu else torch.float32
    if args.gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs CUDA; use --smoke on the CPU")
    if args.out is None:
        if os.environ.get("OUT"):
            args.out = Path(os.environ["OUT"]) / "hf.json"
        elif args.gpu:
            args.out = Path(__file__).parent / "results" / "h100-hf.json"
        else:
            args.out = Path(tempfile.gettempdir()) / "devgraph-hf-smoke.json"

    import transformers

    bench = Bench(args)
    out = {"meta": meta(args, transformers.__version__)}
    out.update(bench.run())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    note = plot(out, args.out.with_suffix(".png"), args.batches)
    print(note or f"wrote {args.out} and {args.out.with_suffix('.png')}")
    print(table(out, args.batches))
    return 0


def meta(args: argparse.Namespace, transformers_version: str) -> dict[str, Any]:
    gpu = args.gpu
    return {
        "device": torch.cuda.get_device_name() if gpu else "cpu (simulated graphs)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers_version,
        "python": sys.version.split()[0],
        "command": shlex.join([sys.executable, *sys.argv]),
        "model": "Qwen3ForCausalLM, Qwen3-0.6B shape" if gpu else "Qwen3ForCausalLM, tiny",
        "shape": QWEN3_06B if gpu else TINY,
        "dtype": str(args.dtype),
        "weights": "random (torch.manual_seed(0))",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "max_cache_len": args.max_cache_len,
        "batches": args.batches,
        "repeats": args.repeats,
        "per_token": "median interval between per-step CUDA events recorded by a logits processor (prefill "
        "excluded), median over --repeats generate() calls",
        "generate_s": "wall seconds of a whole generate() call (prefill included), median of the timed calls",
        "warmup": "hf_compiled: t(1st call) - t(fastest later call) per batch; devgraph: DevgraphDecoder "
        "construction (cache, capture of every size, compiles) + the same first-call extra, all batches",
        "compile_caches": f"{', '.join(COMPILING)} each compile in a fresh inductor/Triton cache directory "
        "(torch._inductor.utils.fresh_cache): cold compiles",
        "cudnn_sdpa": {
            "hf_eager": False,
            "hf_compiled": True,
            "devgraph_exact": False,
            "devgraph_fast": True,
        },
        "issue_8_record": ISSUE_RECORD,
    }


if __name__ == "__main__":
    raise SystemExit(main())
