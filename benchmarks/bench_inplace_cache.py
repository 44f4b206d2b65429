"""Why compiled ``full`` was 75x slower than plain ``full`` on a decoder with one cache written in place,
and what devgraph's fix does: the zoo's ``plain`` decoder (Qwen3-0.6B widths, ``cache[i, rows, :, pos] = k``,
SDPA with a mask) timed as

* ``full``: plain graphs (the reference);
* ``compiled_before``: ``full`` + inductor as devgraph compiled it before the fix (the writes left for
  functionalization) and kept whatever it costs (``keep_compiled``);
* ``compiled_after``: the same with the fix (each write into a slice of the cache a custom op that
  declares its mutation), kept whatever it costs;
* ``compiled_chosen``: ``full`` + inductor as a user gets it: per key the faster of the compiled graph and
  the plain one.

For each compiled variant the JSON holds inductor's generated code measured: how many buffers it allocates
that are at least one layer's cache slice in size, and how many bytes those come to per step (the copies
functionalization asks for). Correctness: each variant's logits against eager on the same step.

    python benchmarks/bench_inplace_cache.py                    # H100: $OUT/inplace-cache.json (+ .png)
    python benchmarks/bench_inplace_cache.py --smoke            # the script on the CPU, tiny shape
    python benchmarks/bench_inplace_cache.py --smoke --code-only 2,4,8   # only inductor's code, CPU

Defaults: 28 layers (the real depth; compile time is what bounds it), batches 1 and 64, bf16.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from harness.device import Budget, Device, start
from harness.plots import Panel, plot_panels
from harness.report import Report, diff, environment, output_path
from harness.targets import Target, targets_table
from harness.timing import Variant, time_cases
from zoo_bench.setup import zoo  # the zoo of tests/ (the module puts tests/ on the path)

import devgraph.strategies.compiling as full_strategy  # where the in-place rewrite is called from
from devgraph import GraphRunner, create_backend

VARIANTS = {
    "full": None,
    "compiled_before": {"keep_compiled": True, "rewrite": False},
    "compiled_after": {"keep_compiled": True, "rewrite": True},
    "compiled_chosen": {"keep_compiled": False, "rewrite": True},
}
_BUFFER = re.compile(r"empty_strided_\w+\(\(([\d, ]*)\)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (simulated graphs)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 28; smoke: 2)")
    parser.add_argument("--batches", help="comma-separated decode batch sizes (default 1,64)")
    parser.add_argument("--out", help="JSON path (default $OUT/inplace-cache.json)")
    parser.add_argument("--time-budget", type=float, default=170.0, help="seconds for the whole run")
    parser.add_argument(
        "--variants",
        help=f"comma-separated variants, in this order (default: all of {','.join(VARIANTS)}; "
        "compiled_before alone takes 80 s at 28 layers on an H200)",
    )
    parser.add_argument(
        "--code-only",
        help="comma-separated layer counts: only compile (static shapes, the largest batch) before and after "
        "the fix and count the cache-sized buffers in inductor's code (no graphs, no timing)",
    )
    return parser.parse_args(argv)


def code_only(args: argparse.Namespace, device: str, dtype: torch.dtype, base: Any, batch: int) -> int:
    """The generated code of the plain decoder at several depths, before and after the fix."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code

    from devgraph.strategies.inplace import keep_writes_in_place

    dev = Device(device)
    path = output_path(
        "inplace-cache-code.json", "benchmarks/results/inplace-cache-code.json", args.out, False
    )
    report = Report(path, {**environment(dev), "dtype": str(dtype), "batch": batch})
    report.data["meta"]["how"] = (
        "torch.compile(plain decoder forward, fullgraph, static shapes) through inductor, the writes into "
        "the cache rewritten (after) or not (before); buffers of inductor's code at least one layer's "
        "cache slice in size"
    )
    report.data["code"] = {}
    elem = torch.empty((), dtype=dtype).element_size()
    for layers in (int(n) for n in args.code_only.split(",")):
        shape = base.with_(layers=layers)
        slice_numel = shape.max_batch * shape.kv_heads * shape.max_len * shape.head_dim
        for rewrite in (False, True):
            model = zoo.build("plain", shape, device, dtype)

            def backend(gm: torch.fx.GraphModule, example: list[Any], rewrite: bool = rewrite) -> Any:
                if rewrite:
                    keep_writes_in_place(gm)
                return compile_fx(gm, example)

            torch._dynamo.reset()
            compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
            with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
                _, sources = run_and_get_code(compiled, **model.make_step(batch, 0))
            stats = {**code_stats(sources, slice_numel, elem), "layer_cache_slice_bytes": slice_numel * elem}
            report.data["code"][f"layers={layers} {'after' if rewrite else 'before'}"] = stats
            print(layers, "after" if rewrite else "before", stats, flush=True)
            report.save()
    print(f"wrote {path}")
    return 0


def code_stats(sources: list[str], slice_numel: int, elem: int) -> dict[str, Any]:
    """Buffers inductor's code allocates that hold at least one layer's cache slice."""
    big = []
    for source in sources:
        for match in _BUFFER.finditer(source):
            dims = [int(d) for d in match.group(1).replace(" ", "").split(",") if d]
            numel = 1
            for d in dims:
                numel *= d
            if dims and numel >= slice_numel:
                big.append(numel)
    return {
        "kernels_source_chars": sum(len(s) for s in sources),
        "cache_sized_buffers": len(big),
        "cache_sized_bytes": sum(big) * elem,
        "write_into_calls": sum(s.count("torch.ops.devgraph.write_into.default(") for s in sources),
    }


def build_variant(
    name: str, model: zoo.ZooModel, batches: list[int], dev: Device, slice_numel: int
) -> Variant:
    options = VARIANTS[name]
    if options is None:
        backend = create_backend(dev.device, "decode", "full")
    else:
        backend = create_backend(
            dev.device,
            "decode",
            "full",
            options={"compiler": "inductor", "keep_compiled": options["keep_compiled"]},
        )
    original = full_strategy.keep_writes_in_place
    if options is not None and not options["rewrite"]:
        full_strategy.keep_writes_in_place = lambda gm: 0  # type: ignore[assignment]  # before the fix
    runner = GraphRunner(
        model.forward,
        sizes=batches,
        backend=backend,
        progress=False,
        device=dev.device,
        **model.runner_kwargs(),
    )
    t0 = time.perf_counter()
    try:
        if options is None:
            runner.capture()
            sources: list[str] = []
        else:
            from torch._inductor.utils import run_and_get_code

            _, sources = run_and_get_code(runner.capture)
    finally:
        full_strategy.keep_writes_in_place = original  # type: ignore[assignment]
    dev.sync()
    info: dict[str, Any] = {"warmup_s": round(time.perf_counter() - t0, 2)}
    inspected = runner.inspect()
    if options is not None:
        elem = torch.empty((), dtype=model.module.k_cache.dtype).element_size()
        info["code"] = code_stats(sources, slice_numel, elem)
        info["compile"] = {
            k: inspected.get(k) for k in ("compile", "compiles", "fallback_kind", "writes_kept_in_place")
        }
        info["compiled_or_plain"] = inspected.get("compiled_or_plain")
        info["notes"] = list(runner.report.notes) if runner.report is not None else []
    return Variant(
        name, lambda case: runner.run(**cases_of(model, batches)[case]), info, runner.close, runner
    )


_CASES: dict[int, dict[str, dict[str, torch.Tensor]]] = {}


def cases_of(model: zoo.ZooModel, batches: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    key = id(model)
    if key not in _CASES:
        _CASES[key] = {f"bs{b}": model.make_step(b, seed=b) for b in batches}
    return _CASES[key]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not start(args.smoke):
        return 2
    budget = Budget(args.time_budget)
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    base = zoo.CPU_TINY.with_(max_batch=8) if args.smoke else zoo.QWEN3_06B_LIKE
    shape = base.with_(layers=args.layers or (2 if args.smoke else 28))
    batches = [int(b) for b in (args.batches or ("1,8" if args.smoke else "1,64")).split(",")]
    if args.code_only:
        return code_only(args, device, dtype, base, max(batches))
    dev = Device(device)
    path = output_path(
        "inplace-cache.json", "benchmarks/results/h100-inplace-cache.json", args.out, args.smoke
    )
    report = Report(path, {**environment(dev), "shape": str(shape), "dtype": str(dtype), "batches": batches})
    report.data["meta"]["how"] = __doc__.split("\n\n", 2)[1].strip()
    model = zoo.build("plain", shape, device, dtype)
    slice_numel = shape.max_batch * shape.kv_heads * shape.max_len * shape.head_dim
    report.data["meta"]["layer_cache_slice_bytes"] = slice_numel * torch.empty((), dtype=dtype).element_size()
    cases = cases_of(model, batches)
    module: Any = model.module
    start_cache = (module.k_cache.clone(), module.v_cache.clone())

    def reset() -> None:  # every step from the same cache: the graphs and eager compute the same step
        module.k_cache.copy_(start_cache[0])
        module.v_cache.copy_(start_cache[1])

    with torch.no_grad():
        reference = {}
        for case, step in cases.items():
            reset()
            reference[case] = model.forward(**step).float().cpu()
        variants = []
        report.data["variants"] = {}
        for name in args.variants.split(",") if args.variants else VARIANTS:
            if name not in VARIANTS:
                report.data["errors"].append(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
                continue
            if variants and not budget.allows(45.0):
                report.data["errors"].append(f"time budget: {name} not run")
                continue
            try:
                variant = build_variant(name, model, batches, dev, slice_numel)
            except Exception as exc:
                report.error(name, exc)
                continue
            variants.append(variant)
            report.data["variants"][name] = dict(variant.info)
            report.save()
        for variant in variants:
            report.data["variants"][variant.name]["diff"] = {}
            for case in cases:
                reset()
                out = variant.step(case).float().cpu()
                report.data["variants"][variant.name]["diff"][case] = diff(out, reference[case])
        timed = time_cases(
            variants,
            list(cases),
            dev,
            iters=6 if args.smoke else 30,
            rounds=2 if args.smoke else 3,
            on_error=lambda what, exc: report.error(what, exc),
            warm_steps=2,
            before_step=reset,
        )
        for variant in variants:
            report.data["variants"][variant.name]["cases"] = timed.get(variant.name, {})
            variant.close()
    data = report.data
    targets = []
    for name in ("compiled_chosen", "compiled_after"):
        ratios = [
            data["variants"][name]["cases"][c]["ms"] / data["variants"]["full"]["cases"][c]["ms"]
            for c in cases
            if name in data["variants"]
            and c in data["variants"][name].get("cases", {})
            and c in data["variants"].get("full", {}).get("cases", {})
        ]
        limit = 1.0 if name == "compiled_chosen" else 1.02
        targets.append(
            Target(f"{name} / plain full latency (worst batch)", max(ratios, default=None), limit, "x")
        )
    data["targets"] = [t.as_dict() for t in targets]
    data["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
    report.save()
    try:
        series = {
            name: [v.get("cases", {}).get(c, {}).get("ms") for c in cases]
            for name, v in data["variants"].items()
        }
        plot_panels(
            path.with_suffix(".png"),
            [Panel(f"plain decoder, {shape.layers} layers", list(cases), series, xlabel="decode batch")],
            f"one cache written in place, on {data['meta']['device']}, torch {data['meta']['torch']}",
        )
    except Exception as exc:
        report.error("plot", exc)
        report.save()
    for name, v in data["variants"].items():
        cells = "  ".join(f"{c} {r['ms']:.3f} ms" for c, r in v.get("cases", {}).items())
        print(f"{name:<16} warm-up {v.get('warmup_s')} s  {cells}  code {json.dumps(v.get('code'))}")
    print(targets_table(targets))
    if args.smoke:
        print("\n--smoke: the CPU simulator replays by re-running ops; its timings say nothing about a GPU")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
