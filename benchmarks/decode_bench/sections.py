"""The decode benchmark's sections (:class:`Bench`): setup, decode (with the compiled mode early), host
time, the reduce-overhead process, prefill, verify, warm-ups and the fresh-process warm-ups, in that order,
each only when the time budget allows it."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import statistics
import threading
import time
import timeit
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from harness.children import child_env, run_child, script_command
from harness.device import Budget, host_us
from harness.floor import copy_bandwidth, floor_ms, step_bytes
from harness.report import Report, diff
from harness.timing import Variant, time_cases

from decode_bench.host import break_cost
from decode_bench.plan import Plan, decode_case
from decode_bench.setup import Setup, build_setup
from decode_bench.variants import check_variant, eager_variant, hand_variant, runner_variant

__all__ = ["Bench"]

log = logging.getLogger("bench_decode")

#: What the reduce-overhead process is given at least (its compile of four sizes alone took 67 s on an H100).
RO_SECONDS = 150.0


class Bench:
    """The decode benchmark in one process, section by section; each section asks the budget first and a
    section's failure is recorded while the run goes on."""

    def __init__(
        self, args: argparse.Namespace, plan: Plan, report: Report, budget: Budget, cache_root: Path
    ) -> None:
        self.args, self.plan, self.report, self.budget = args, plan, report, budget
        self.cache_root = cache_root
        self.children = cache_root / "children"
        self.children.mkdir(parents=True, exist_ok=True)
        #: Seconds the optional sections leave to the reduce-overhead process until it has run.
        self.kept = 0.0 if args.no_ro else RO_SECONDS
        self.data = report.data
        self.setup: Setup | None = None
        self.variants: dict[str, dict[str, Variant]] = {"decode": {}, "prefill": {}, "verify": {}}

    # small helpers
    @contextmanager
    def section(self, what: str) -> Iterator[None]:
        log.info("%s (t=%.0fs, cpu %.0fs)", what, self.budget.elapsed(), time.process_time())
        try:
            yield
        except Exception as exc:
            self.report.error(what, exc)
        finally:
            self.report.save()

    def add(
        self, phase: str, build: Callable[[], Variant], name: str, estimate_s: float, keep: float = 0.0
    ) -> None:
        """Build and record a variant when the budget allows ``estimate_s`` seconds beyond ``keep``."""
        if not self.budget.allows(estimate_s + keep):
            self.data[phase].setdefault("skipped", {})[name] = f"time budget: {self.budget.left():.0f}s left"
            return
        try:
            variant = build()
        except Exception as exc:
            self.report.error(f"{phase} {name} build", exc)
            return
        self.variants[phase][variant.name] = variant
        self.data[phase]["variants"][variant.name] = variant.info
        log.info(
            "  %s %s: %s", phase, variant.name, {k: variant.info.get(k) for k in ("capture_s", "graph_MiB")}
        )

    def add_eager(self, phase: str, attentions: Sequence[str]) -> None:
        assert self.setup is not None
        for attention in attentions:
            v = eager_variant(self.setup, phase, attention)
            self.variants[phase][v.name] = v
            self.data[phase]["variants"][v.name] = v.info

    def time_phase(self, phase: str) -> None:
        s = self.setup
        assert s is not None
        section = self.data[phase]
        for name, v in self.variants[phase].items():
            try:
                section["correctness"][name] = check_variant(s, phase, v)
            except Exception as exc:
                self.report.error(f"{phase} {name} correctness", exc)
        timed = time_cases(
            list(self.variants[phase].values()),
            list(s.batches[phase]),
            s.dev,
            iters=self.plan.iters,
            rounds=self.plan.rounds,
            warm_steps=self.plan.warm_steps,
            on_error=lambda what, exc: self.report.error(f"{phase} timing {what}", exc),
        )
        section["latency_ms"] = {n: {c: r["ms"] for c, r in per.items()} for n, per in timed.items()}
        section["host_ms"] = {n: {c: r["host_ms"] for c, r in per.items()} for n, per in timed.items()}
        floors = section.get("floor_ms", {})
        section["ratio_to_floor"] = {
            n: {c: round(ms / floors[c], 3) for c, ms in per.items() if floors.get(c)}
            for n, per in section["latency_ms"].items()
        }

    def close_phase(self, phase: str) -> None:
        for name, v in self.variants[phase].items():
            try:
                v.close()
            except Exception as exc:
                self.report.error(f"{phase} {name} close", exc)
        self.variants[phase].clear()
        if self.setup is not None:
            self.setup.dev.settle(full_gc=True)

    # sections, most wanted first: whatever the budget cuts is at the end
    def run(self) -> None:
        device = torch.device("cpu" if self.args.smoke else "cuda")
        for phase in ("decode", "prefill", "verify"):
            self.data[phase] = {"variants": {}, "correctness": {}}
        with self.section("setup"):
            torch.manual_seed(0)
            self.setup = build_setup(self.plan, device)
            self.describe_setup()
        if self.setup is None:
            return
        with self.section("decode"):
            self.decode()
        with self.section("host time"):
            self.host_time()
        self.close_phase("decode")
        with self.section("reduce-overhead process"):
            self.reduce_overhead()
        with self.section("prefill"):
            self.prefill()
        self.close_phase("prefill")
        with self.section("verify"):
            self.verify()
        self.close_phase("verify")
        with self.section("warm-ups"):
            self.warmups()
        with self.section("fresh-process warm-ups"):
            self.fresh_processes()

    def describe_setup(self) -> None:
        s = self.setup
        assert s is not None
        c = s.paged.config
        bandwidth = copy_bandwidth(s.dev, self.plan.bandwidth_bytes)
        self.data["meta"].update(
            model={
                "preset": self.plan.preset,
                **{f.name: str(getattr(c, f.name)) for f in dataclasses.fields(c)},
                "total_blocks": c.total_blocks,
                "weight_bytes": sum(p.numel() * p.element_size() for p in s.paged.parameters()),
                "kv_cache_bytes": sum(
                    t.numel() * t.element_size() for t in (*s.paged.k_cache, *s.paged.v_cache)
                ),
            },
            setup_s=round(s.build_s, 1),
            bandwidth=bandwidth,
            plan=dataclasses.asdict(self.plan),
            timing="CUDA events around each step (host start to last kernel), median; variants interleaved",
            graph_bytes="growth of memory_reserved across capture, the allocator's cache emptied around it",
            kv_layout="read-only random context blocks + private blocks for each batch's writes (KVPlan)",
        )
        gbps = bandwidth["GBps"]
        for phase, cases in s.batches.items():
            floors, parts = {}, {}
            for case, batch in cases.items():
                rows = batch["seq_lens"].shape[0] if phase == "prefill" else batch["input_ids"].shape[0]
                parts[case] = step_bytes(s.paged, batch, int(rows))
                floors[case] = round(floor_ms(parts[case], gbps), 4)
            self.data[phase]["floor_ms"] = floors
            self.data[phase]["floor_bytes"] = parts
        # eager with the two attentions, same weights and cache: how far apart their kernels round
        self.data["attention_agreement"] = {
            phase: {c: diff(s.refs[phase]["sdpa"][c], s.refs[phase]["paged"][c]) for c in s.batches[phase]}
            for phase in ("decode", "prefill")
        }

    def add_strategies(self, phase: str, after_full: Callable[[], None] = lambda: None) -> None:
        """Eager, the hand-written graph and every strategy on paged and sdpa attention, for ``phase``."""
        s = self.setup
        assert s is not None
        self.add_eager(phase, ("paged", "sdpa"))
        self.add(phase, lambda: hand_variant(s, phase), "hand", 5)
        self.add(phase, lambda: runner_variant(s, phase, "full", "paged", "full"), "full", 5)
        after_full()
        for name, attention, mode, estimate in (
            ("breakable", "paged", "breakable", 5),
            ("breakable_sdpa", "sdpa", "breakable", 8),
            ("tc_piecewise", "paged", "tc_piecewise", 15),
            ("tc_piecewise_sdpa", "sdpa", "tc_piecewise", 15),
        ):
            build = functools.partial(runner_variant, s, phase, name, attention, mode)
            self.add(phase, build, name, estimate, keep=self.kept)  # after the reduce-overhead process

    def decode(self) -> None:
        """Eager, hand and ``full``, then ``full`` + inductor (the compiled mode, which an earlier run's
        budget never reached), then the other strategies."""
        s = self.setup
        assert s is not None
        phase = "decode"
        compiled = json.dumps({"decode": {"backend": "full", "compiler": self.plan.compiler}})
        self.add_strategies(
            phase,
            after_full=lambda: self.add(
                phase,
                lambda: runner_variant(s, phase, "full_inductor", "paged", compiled),
                "full_inductor",
                60,
            ),
        )
        full_inductor = self.data[phase]["variants"].get("full_inductor")
        if full_inductor is not None:
            full_inductor["warmup_s"] = full_inductor["capture_s"]  # compile + warm-ups + capture, 4 sizes
        self.report.save()
        self.time_phase(phase)

    def prefill(self) -> None:
        if not self.budget.allows(30):
            self.data["prefill"]["skipped"] = f"time budget: {self.budget.left():.0f}s left"
            return
        self.add_strategies("prefill")
        self.report.save()
        self.time_phase("prefill")

    def verify(self) -> None:
        s = self.setup
        assert s is not None
        phase = "verify"
        if not self.budget.allows(20):
            self.data[phase]["skipped"] = f"time budget: {self.budget.left():.0f}s left"
            return
        self.add_eager(phase, ("paged",))
        self.add(phase, lambda: hand_variant(s, phase), "hand", 5)
        self.add(phase, lambda: runner_variant(s, phase, "full", "paged", "full"), "full", 5)
        self.time_phase(phase)

    # -- host time -------------------------------------------------------------------------------------------
    def host_time(self) -> None:
        s = self.setup
        assert s is not None
        dev, iters = s.dev, self.plan.host_iters
        out: dict[str, Any] = {}
        case = decode_case(1, self.plan.contexts[0])
        batch = s.batches["decode"][case]
        full = self.variants["decode"].get("full")
        hand = self.variants["decode"].get("hand")
        # The lock's cost: the same runner built with single_thread=True (no lock), rounds interleaved.
        lone = None
        if full is not None and self.budget.allows(10 + self.kept):
            lone = runner_variant(s, "decode", "full_single_thread", "paged", "full", single_thread=True)
        if full is not None and lone is not None:
            with_lock, without_lock = [], []
            for _ in range(5):  # rounds, interleaved
                with_lock.append(host_us(dev, lambda: full.runner.run(**batch), iters))
                without_lock.append(host_us(dev, lambda: lone.runner.run(**batch), iters))
            lone.close()
            out["run_us"] = round(statistics.median(with_lock), 2)
            out["run_us_no_lock"] = round(statistics.median(without_lock), 2)
            out["lock_us"] = round(out["run_us"] - out["run_us_no_lock"], 2)
            out["run_us_rounds"] = [round(x, 2) for x in with_lock]
        inductor = self.variants["decode"].get("full_inductor")
        if inductor is not None:
            out["run_us_full_inductor"] = round(host_us(dev, lambda: inductor.runner.run(**batch), iters), 2)
        if hand is not None:
            out["hand_run_us"] = round(host_us(dev, lambda: hand.runner.run(batch), iters), 2)
            graph = hand.runner.graphs[hand.runner.key_for(batch)]
            out["graph_replay_us"] = round(host_us(dev, graph.replay, iters), 2)
        out["raw_rlock_ns"] = round(
            min(
                timeit.repeat(
                    "with lock: pass", number=200_000, repeat=5, globals={"lock": threading.RLock()}
                )
            )
            / 200_000
            * 1e9,
            1,
        )
        out["definition"] = (
            f"run_us: median host microseconds of GraphRunner.run(**batch) for decode batch 1 ({case}), full "
            "(paged), the device synchronized before each call and not inside it (what the engine's thread "
            "pays per step); run_us_no_lock: the same runner built with single_thread=True, which takes no "
            "lock (rounds interleaved); hand_run_us: the hand-written copy-in + replay; graph_replay_us: "
            "CUDAGraph.replay() alone"
        )
        self.data["host_time"] = out
        self.data["break_cost"] = break_cost(dev, self.plan.breaks, self.plan.host_iters)

    # -- warm-ups --------------------------------------------------------------------------------------------
    def warmups(self) -> None:
        s = self.setup
        assert s is not None
        phase, rows = "decode", self.data.setdefault("warmups", {}).setdefault("this_process", {})
        modes = {
            "hand": ("paged", None),
            "full": ("paged", "full"),
            "breakable_sdpa": ("sdpa", "breakable"),
            "tc_piecewise_sdpa": ("sdpa", "tc_piecewise"),
        }
        estimates = {"hand": 3, "full": 3, "breakable_sdpa": 5, "tc_piecewise_sdpa": 15}
        reused = self.data["decode"]["variants"].get("tc_piecewise_sdpa")
        for w in self.plan.warmups:
            for name, (attention, mode) in modes.items():
                key = f"{name}@{w}"
                if name == "tc_piecewise_sdpa" and w == 2 and reused is not None:
                    checks = self.data["decode"]["correctness"].get(name, {})
                    correct = bool(checks) and all(
                        e.get("ok") and e.get("max_abs_same_padded") == 0 for e in checks.values()
                    )
                    rows[key] = {**reused, "note": "the decode section's runner", "captured": True}
                    rows[key]["correct"] = correct
                    continue
                if not self.budget.allows(estimates[name]):
                    rows[key] = {"skipped": f"time budget: {self.budget.left():.0f}s left"}
                    continue
                try:
                    if mode is None:
                        v = hand_variant(s, phase, warmup_iters=w)
                    else:
                        v = runner_variant(s, phase, name, attention, mode, warmup_iters=w)
                except Exception as exc:
                    self.report.error(f"warm-ups {key}", exc)
                    rows[key] = {"captured": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    continue
                try:
                    checks = check_variant(s, phase, v)
                    exact = all(e.get("max_abs_same_padded") == 0 for e in checks.values())
                    ok = all(e.get("ok", True) for e in checks.values())
                    rows[key] = {**v.info, "captured": True, "correct": ok and exact, "checks": checks}
                finally:
                    v.close()
                    s.dev.settle()
                self.report.save()
        self.data["warmups"]["definition"] = (
            "decode sizes 1, 8, 32, 64 captured with warmup_iters eager runs per size before each capture; "
            "correct: every decode case equals eager on the same padded step (verify) exactly. This process "
            "had already run every kernel (warm); 'fresh_process' has the first capture of new processes."
        )

    # -- child processes -------------------------------------------------------------------------------------
    def reduce_overhead(self) -> None:
        """``torch.compile(mode="reduce-overhead")`` in a process of its own, given what the budget has left
        (the decode section's optional variants left it :data:`RO_SECONDS`)."""
        self.kept = 0.0
        if self.args.no_ro or not self.budget.allows(RO_SECONDS / 2):
            self.data["reduce_overhead"] = {"skipped": "--no-ro" if self.args.no_ro else self._no_time()}
            return
        out = self.children / "ro.json"
        command = script_command(self.args.script, "--child", "ro", "--out", str(out), *self._smoke())
        env = child_env(self.cache_root, "ro")
        self.data["reduce_overhead"] = run_child(command, out, env, self.budget, cap=600, keep=20)

    def fresh_processes(self) -> None:
        """The first capture of fresh processes with 0 and 1 warm-ups, one after the other, last: they cost a
        process start, a model build and captures each, and say the least."""
        fresh = self.data.setdefault("warmups", {}).setdefault("fresh_process", {})
        for w in (0, 1):
            if self.args.no_probes or not self.budget.allows(60):
                fresh[str(w)] = {"skipped": "--no-probes" if self.args.no_probes else self._no_time()}
                continue
            out = self.children / f"probe{w}.json"
            command = script_command(self.args.script, "--child", "probe", "--out", str(out), *self._smoke())
            command += ["--warmup-iters", str(w)]
            try:
                fresh[str(w)] = run_child(
                    command, out, child_env(self.cache_root, f"p{w}"), self.budget, cap=180
                )
            except Exception as exc:
                self.report.error(f"fresh-process probe warmup_iters={w}", exc)
            self.report.save()

    def _smoke(self) -> list[str]:
        return ["--smoke"] if self.args.smoke else []

    def _no_time(self) -> str:
        return f"time budget: {self.budget.left():.0f}s left"
