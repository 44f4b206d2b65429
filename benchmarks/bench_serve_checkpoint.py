"""``devgraph serve --model DIR`` on a Qwen3-0.6B-shaped checkpoint, against transformers on the same one.

    python benchmarks/bench_serve_checkpoint.py --gpu     # H100: $OUT/serve-checkpoint.json + .png, < 8 min
    python benchmarks/bench_serve_checkpoint.py --smoke   # the same script on the CPU, tiny shape, ~1 min

1. **Checkpoint** (``checkpoint_bench/build.py``): built here (no network on the GPU machine) in a temporary
   folder, not under ``$OUT``: Qwen3-0.6B's config, random bf16 weights saved with ``save_pretrained``, a BPE
   tokenizer trained locally with a chat template.
2. **transformers** (``checkpoint_bench/hf.py``), in this process: the oracle (eager ``generate()``, greedy,
   batch 1, each of 8 prompts of random ids, 64 new tokens), then the compiled static-cache ``generate()``
   at batch 1 (per-token latency) and batch 32 (tokens/s), each after a warm-up call that compiles.
3. **devgraph serve** (``checkpoint_bench/servers.py``), one subprocess per configuration, in this order:
   ``--deterministic`` (the oracle's target), the default engine, ``--deterministic --dtype float32`` (the
   same weights in float32 against transformers in float32: agreement that does not hang on bf16 rounding;
   the oracle prompts only), and the default engine with the decode graphs compiled by inductor
   (``{"decode": {"backend": "full", "compiler": "inductor"}}``). Each: start-up (listening, first
   response, the server's own stages), the oracle prompts alone and all at once, then load: 16 requests at
   concurrency 1 and 64 at concurrency 32 (prompts of 32-256 random ids, 64-128 new tokens, streaming,
   greedy).
4. **Report** (``checkpoint_bench/report.py``): tokens equal to transformers per prompt (or the first
   differing token), the targets (every prompt equal in ``--deterministic``; ITL p50 at concurrency 1 at most
   0.8x HF compiled's per-token latency; tokens/s at concurrency 32 at least 3x HF compiled's at batch 32),
   start-up, the JSON and a PNG.

``--time-budget`` (default 420 s on the GPU) is honoured: each section asks first and what would not fit is
skipped and recorded (``skipped``): the servers last in the order above first, then HF at batch 32; a
server's start-up may take at most what the budget has left.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_bench import hf
from checkpoint_bench.build import build_checkpoint, prompt_set
from checkpoint_bench.plan import GPU, SMOKE, Plan
from checkpoint_bench.report import agreement, plot, targets
from checkpoint_bench.servers import run_config
from harness.device import Budget, Device, start
from harness.report import Report, environment, output_path
from harness.targets import targets_table

#: Configurations whose tokens are compared with transformers in float32 instead of the checkpoint's dtype.
FP32 = "deterministic_fp32"


class Run:
    def __init__(self, plan: Plan, args: argparse.Namespace, report: Report) -> None:
        self.plan, self.args, self.report = plan, args, report
        self.budget = Budget(args.time_budget or plan.time_budget)
        self.data = report.data
        self.data.update(servers={}, hf={}, skipped=[], new_tokens=plan.new_tokens)
        self.work = Path(tempfile.mkdtemp(prefix="devgraph-checkpoint-"))
        self.checkpoint = self.work / "qwen3-0.6b-random"
        self.prompts: list[list[int]] = []
        self.oracle: dict[str, list[list[int]]] = {}

    def skip(self, what: str) -> None:
        self.data["skipped"].append(f"{what}: {self.budget.left():.0f} s of the time budget left")
        print(f"skipped {what} ({self.budget.left():.0f} s left)", flush=True)

    def transformers_part(self) -> None:
        plan = self.plan
        self.data["checkpoint"] = build_checkpoint(self.checkpoint, plan.shape, plan.dtype, plan.device)
        self.prompts = prompt_set(plan.prompts, plan.prompt_len, plan.shape["vocab_size"])
        self.data["prompt_lengths"] = [len(p) for p in self.prompts]
        model = hf.load(self.checkpoint, plan.dtype, plan.device)
        try:
            tokens, seconds = hf.greedy(model, self.prompts, plan.new_tokens)
            self.oracle[plan.dtype] = tokens
            self.data["hf"]["eager_oracle"] = {
                "seconds": round(seconds, 1),
                "distinct_tokens": [len(set(t)) for t in tokens],
            }
            for batch in plan.hf_batches:
                if not self.budget.allows(plan.estimates["hf"] / 2 + self._servers_floor()):
                    self.skip(f"HF compiled at batch {batch}")
                    continue
                try:
                    self.data["hf"][f"compiled_b{batch}"] = hf.compiled(
                        model, batch, plan.hf_prompt_len, plan.hf_new_tokens, plan.hf_repeats, plan.hf_compile
                    )
                except Exception as exc:  # keep the rest of the run
                    self.report.error(f"HF compiled at batch {batch}", exc)
                print(f"HF: {self.data['hf']}", flush=True)
        finally:
            hf.release(model)
        self.report.save()

    def _servers_floor(self) -> float:
        """Seconds the servers that matter most need: the deterministic and default ones."""
        return sum(self.plan.estimates.get(n, 0) for n in ("deterministic", "default"))

    def oracle_for(self, name: str) -> list[list[int]]:
        dtype = "float32" if name == FP32 else self.plan.dtype
        if dtype not in self.oracle:
            model = hf.load(self.checkpoint, dtype, self.plan.device)
            try:
                self.oracle[dtype] = hf.greedy(model, self.prompts, self.plan.new_tokens)[0]
            finally:
                hf.release(model)
        return self.oracle[dtype]

    def servers_part(self) -> None:
        out = self.report.path.parent
        for name, flags in self.plan.configs.items():
            if not self.budget.allows(self.plan.estimates.get(name, 60)):
                self.skip(f"server {name}")
                continue
            try:
                expected = self.oracle_for(name)
                timeout = min(self.plan.start_timeout, max(30.0, self.budget.left() - 30))
                record = run_config(name, flags, self.plan, self.checkpoint, self.prompts, out, timeout)
                record["agreement_alone"] = agreement(record.pop("oracle_alone"), expected)
                record["agreement_loaded"] = agreement(record.pop("oracle_loaded"), expected)
                record["compared_with"] = (
                    f"transformers eager, {'float32' if name == FP32 else self.plan.dtype}"
                )
                self.data["servers"][name] = record
            except Exception as exc:
                self.report.error(f"server {name}", exc)
            self.report.save()

    def finish(self) -> int:
        low, high = list(self.plan.scenarios)
        found = targets(self.data, low, high)
        self.data["targets"] = [t.as_dict() for t in found]
        self.data["seconds"] = round(self.budget.elapsed(), 1)
        self.report.save()
        note = plot(self.data, self.report.path.with_suffix(".png"), low, high)
        print(note or f"wrote {self.report.path} and {self.report.path.with_suffix('.png')}")
        print(targets_table(found))
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        exits = [s.get("exit_code") for s in self.data["servers"].values()]
        return 0 if exits and all(code == 0 for code in exits) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", action="store_true", help="Qwen3-0.6B shape, bf16, on CUDA")
    where.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (simulated graphs)")
    parser.add_argument(
        "--time-budget", type=float, default=None, help="seconds (default: 420 GPU, 180 smoke)"
    )
    parser.add_argument("--out", default=None, help="the JSON's path (default: $OUT/serve-checkpoint.json)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the checkpoint (printed) instead of deleting it"
    )
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else GPU
    if not start(args.smoke):
        return 2
    path = output_path(
        "serve-checkpoint.json", "benchmarks/results/h100-serve-checkpoint.json", args.out, args.smoke
    )
    meta = environment(Device(plan.device))
    import transformers

    meta.update(transformers=transformers.__version__, plan=plan.__dict__)
    report = Report(path, meta)
    run = Run(plan, args, report)
    began = time.perf_counter()
    try:
        run.transformers_part()
        run.servers_part()
    except Exception as exc:
        report.error("run", exc)
    kept = f"kept in {run.work}" if args.keep else "deleted"
    print(f"{time.perf_counter() - began:.0f} s; the checkpoint is {kept}")
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
