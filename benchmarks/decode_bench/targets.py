"""The decode benchmark's targets, computed from its JSON (latency against the bandwidth floor and against
reduce-overhead, warm-up time, prefill packing and memory, host time, exactness)."""

from __future__ import annotations

from typing import Any

from harness.targets import Target

from decode_bench.plan import Plan, decode_case, prefill_case

__all__ = ["compute_targets"]


DEVGRAPH_DECODE = (
    "full",
    "full_inductor",
    "breakable",
    "breakable_sdpa",
    "tc_piecewise",
    "tc_piecewise_sdpa",
)


def compute_targets(data: dict[str, Any], plan: Plan) -> list[Target]:
    dec, pre = data.get("decode", {}), data.get("prefill", {})
    lat = dec.get("latency_ms", {})
    c0 = plan.contexts[0]
    first, last = plan.decode_batches[0], plan.decode_batches[-1]
    targets = []
    full = lat.get("full", {})
    floors = dec.get("floor_ms", {})
    # `full` with its default (eager) compiler and with `compiler: inductor`: both are the `full` backend
    # over the Triton paged attention; the latency target is for that backend.
    for name, label in (("full", "full"), ("full_inductor", "full+inductor")):
        for b, limit in ((first, 2.0), (last, 6.0)):
            case = decode_case(b, c0)
            floor, value = floors.get(case), lat.get(name, {}).get(case)
            detail = f"bandwidth floor {floor} ms ({value / floor:.2f}x floor)" if floor and value else ""
            targets.append(Target(f"decode {label} (paged) {case} ms", value, limit, " ms", detail=detail))
    ro = data.get("reduce_overhead", {}).get("latency_ms", {}).get("reduce_overhead", {})
    ro_full = data.get("reduce_overhead", {}).get("latency_ms", {}).get("full", {})
    for case in dec.get("floor_ms", {}):
        best = min(((lat[n][case], n) for n in DEVGRAPH_DECODE if case in lat.get(n, {})), default=None)
        if best is None or case not in ro:
            targets.append(Target(f"decode best devgraph / reduce-overhead {case}", None, 1.0, "x"))
            continue
        drift = f", full here/there {full.get(case, float('nan')) / ro_full.get(case, float('nan')):.3f}"
        targets.append(
            Target(
                f"decode best devgraph / reduce-overhead {case}",
                best[0] / ro[case],
                1.0,
                "x",
                detail=f"{best[1]} {best[0]} ms vs {ro[case]} ms (own process){drift}",
            )
        )
    ro_warm = data.get("reduce_overhead", {}).get("warmup_s")
    ind = dec.get("variants", {}).get("full_inductor", {}).get("warmup_s")
    targets.append(
        Target(
            "warm-up full+inductor / reduce-overhead (4 sizes)",
            ind / ro_warm if ind and ro_warm else None,
            0.2,
            "x",
            detail=f"{ind} s vs {ro_warm} s",
        )
    )
    plat = pre.get("latency_ms", {})
    packed = [prefill_case(c) for c in plan.prefill_cases if len(c) > 1]
    single = prefill_case((sum(plan.prefill_cases[-1]),))
    pfull = plat.get("full", {})
    for case in packed:
        if case in pfull and single in pfull:
            targets.append(Target(f"prefill full {case} / {single}", pfull[case] / pfull[single], 1.05, "x"))
    brk = plat.get("breakable", {})
    for case in plat.get("full", {}):
        ratio = brk[case] / pfull[case] if case in brk else None
        targets.append(Target(f"prefill breakable(paged) / full {case}", ratio, 1.15, "x"))
    pvars = pre.get("variants", {})
    full_bytes = pvars.get("full", {}).get("graph_bytes")
    for name in ("breakable", "breakable_sdpa", "tc_piecewise", "tc_piecewise_sdpa"):
        nbytes = pvars.get(name, {}).get("graph_bytes")
        ratio = nbytes / full_bytes if nbytes is not None and full_bytes else None
        targets.append(
            Target(
                f"prefill graph memory {name} / full",
                ratio,
                1.25,
                "x",
                detail=f"{nbytes} vs {full_bytes} bytes",
            )
        )
    host = data.get("host_time", {})
    run_us, hand_us = host.get("run_us"), host.get("hand_run_us")
    # devgraph's own share: what run() costs beyond the hand-written step on the same batch (which copies
    # the same inputs into its static buffers, pads and replays the same graph).
    targets.append(
        Target(
            "devgraph's own host time per run(), decode b1 (run() - hand step)",
            run_us - hand_us if run_us is not None and hand_us is not None else None,
            30.0,
            " us",
            detail=f"run() {run_us} us, hand step {hand_us} us, bare replay {host.get('graph_replay_us')} us",
        )
    )
    for key, form in (("devgraph_per_break_us", "new tensor"), ("devgraph_per_break_into_us", "into an arg")):
        targets.append(
            Target(
                f"devgraph host time per break (op returns {form})",
                data.get("break_cost", {}).get(key),
                5.0,
                " us",
            )
        )
    warm = data.get("warmups", {}).get("this_process", {})
    for w in plan.warmups:
        f, h = warm.get(f"full@{w}", {}).get("capture_s"), warm.get(f"hand@{w}", {}).get("capture_s")
        targets.append(
            Target(f"capture time full / hand, warmup_iters={w}", f / h if f and h else None, 1.0, "x")
        )
    dvars = dec.get("variants", {})
    if "full" in dvars and "hand" in dvars:
        targets.append(
            Target(
                "decode capture time full / hand (default warm-ups)",
                dvars["full"]["capture_s"] / dvars["hand"]["capture_s"],
                1.0,
                "x",
            )
        )
    worst = 0.0
    for phase in ("decode", "prefill", "verify"):
        for per in data.get(phase, {}).get("correctness", {}).values():
            for entry in per.values():
                value = entry.get("max_abs_same_padded")
                if value is not None:
                    worst = max(worst, value)
    targets.append(Target("every graph == eager on the same padded step (max |diff|)", worst, 0.0))
    return targets
