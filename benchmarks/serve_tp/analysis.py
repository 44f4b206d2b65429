"""The figures ``serve_tp_check.py`` reports: per load phase from the server's step timeline, the memory
bandwidth floor of a decode step, and the targets of issue 30 (items 2 and 4) checked against them."""

from __future__ import annotations

import bisect
import statistics
from typing import Any

import torch

__all__ = ["bandwidth_floor", "hosts", "targets", "window"]

#: Spec memory bandwidth (bytes/s) by device name, for the floor the issue states (16 GB / 3.35 TB/s).
SPEC_BANDWIDTH = {"H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "H200": 4.8e12, "H20": 4.0e12}
#: Gaps longer than this are the server waiting for work (a client between requests), not step overhead.
IDLE_CUTOFF_MS = 50.0


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 4),
        "p10": round(ordered[int(0.1 * (len(ordered) - 1))], 4),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "mean": round(statistics.fmean(ordered), 4),
    }


def window(steps: list[dict[str, Any]], began: float, ended: float) -> dict[str, Any]:
    """The steps whose host start lies in [began, ended]: the device time of a decode step (staging +
    replay, CUDA events) by batch size, and the device's idle time between consecutive steps."""
    inside = [s for s in steps if began <= s["host_s"] <= ended]
    if not inside:
        return {"steps": 0}
    decode = [s for s in inside if s["phase"] == "decode"]
    device = [s["device_end_ms"] - s["device_start_ms"] for s in inside]
    gaps = [b["device_start_ms"] - a["device_end_ms"] for a, b in zip(inside, inside[1:], strict=False)]
    working = [max(0.0, g) for g in gaps if g <= IDLE_CUTOFF_MS]
    span = sum(device) + sum(working)
    by_batch: dict[int, list[float]] = {}
    for step in decode:
        by_batch.setdefault(step["requests"], []).append(step["device_end_ms"] - step["device_start_ms"])
    common = max(by_batch, key=lambda k: len(by_batch[k])) if by_batch else None
    return {
        "steps": len(inside),
        "decode_steps": len(decode),
        "decode_device_ms": _spread([s["device_end_ms"] - s["device_start_ms"] for s in decode]),
        "decode_batch_most_common": common,
        "decode_device_ms_at_that_batch": _spread(by_batch[common]) if common is not None else {},
        "gap_ms": _spread(working),
        "gaps_over_cutoff": len(gaps) - len(working),
        "idle_share": round(sum(working) / span, 4) if span > 0 else None,
    }


def hosts(
    spans: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    worker_spans: list[dict[str, Any]],
    began: float,
    ended: float,
) -> dict[str, Any]:
    """The hosts' side of the steps whose rank-0 span starts in [began, ended], in milliseconds:

    - ``issue_ms``: rank 0's time inside a forward's issue (host clock), all forwards and decode ones
      alone (``decode``): long ones are the host blocked or slow between two steps' device work; a decode
      forward's issue split at its runner's ``run`` into ``before_run_ms`` (the message's copy to the
      device, under ``--tp`` the channel's send, then the device step's work before the forward:
      copy-on-write blocks, the block-table changes, the gather of the step's ids, under ``--tp`` their
      broadcast), ``run_ms`` (input staging, the replay's launch) and ``after_run_ms`` (sampling, the
      copies back to the host); each part's figures are over the decode forwards whose run was found
      inside them, so their medians need not add up to the issue's; ``cpu_ms``, the engine thread's CPU
      time in a decode issue, and ``waiting_share``, the share of the decode issues' time it did not run
      (the interpreter lock held by another thread, a blocking call);
    - ``cadence_ms``: between the starts of consecutive forwards on rank 0 (the host's step; under the
      overlapped scheduler it is the device's step once the host keeps up);
    - ``kinds``: how many forwards of each kind;
    - under ``--tp``, per worker (matched by step number): ``lag_ms``, from rank 0 starting a forward to
      that worker holding its message (the channel in service: the copy, the ring, the worker's wait);
      ``issue_ms``, the worker's own issue; ``behind_ms``, how long after the previous step's issue
      the worker got this one (near the device's step: it kept up; near zero: it was late and the
      message was waiting)."""
    inside = [s for s in spans if began <= s["host_s"] <= ended and "host_end_s" in s]
    if not inside:
        return {}
    kinds: dict[str, int] = {}
    for span in inside:
        kinds[span["phase"]] = kinds.get(span["phase"], 0) + 1
    decode = [s for s in inside if s["phase"] == "decode"]
    timed_runs = sorted((r for r in runs if "host_end_s" in r), key=lambda r: r["host_s"])
    starts = [r["host_s"] for r in timed_runs]
    split: dict[str, list[float]] = {"before_run_ms": [], "run_ms": [], "after_run_ms": []}
    for span in decode:
        at = bisect.bisect_left(starts, span["host_s"])
        if at < len(timed_runs) and timed_runs[at]["host_end_s"] <= span["host_end_s"]:
            run = timed_runs[at]
            split["before_run_ms"].append(1e3 * (run["host_s"] - span["host_s"]))
            split["run_ms"].append(1e3 * (run["host_end_s"] - run["host_s"]))
            split["after_run_ms"].append(1e3 * (span["host_end_s"] - run["host_end_s"]))
    timed = [s for s in decode if "host_cpu_ms" in s]
    wall = sum(1e3 * (s["host_end_s"] - s["host_s"]) for s in timed)
    out: dict[str, Any] = {
        "kinds": kinds,
        "issue_ms": _spread([1e3 * (s["host_end_s"] - s["host_s"]) for s in inside]),
        "decode": {
            "issue_ms": _spread([1e3 * (s["host_end_s"] - s["host_s"]) for s in decode]),
            **{name: _spread(values) for name, values in split.items()},
            "cpu_ms": _spread([s["host_cpu_ms"] for s in timed]),
            "waiting_share": round(1 - sum(s["host_cpu_ms"] for s in timed) / wall, 4) if wall > 0 else None,
        },
        "cadence_ms": _spread(
            [1e3 * (b["host_s"] - a["host_s"]) for a, b in zip(inside, inside[1:], strict=False)]
        ),
    }
    if worker_spans:
        by_step = {s["step"]: s for s in worker_spans if "step" in s}
        pairs = [(s, by_step[s["step"]]) for s in inside if s["step"] in by_step]
        previous = {s["step"]: p for p, s in zip(worker_spans, worker_spans[1:], strict=False) if "step" in s}
        out["worker"] = {
            "steps_matched": len(pairs),
            "lag_ms": _spread([1e3 * (w["host_s"] - r["host_s"]) for r, w in pairs]),
            "issue_ms": _spread([1e3 * (w["host_end_s"] - w["host_s"]) for _, w in pairs]),
            "behind_ms": _spread(
                [
                    1e3 * (w["host_s"] - previous[w["step"]]["host_end_s"])
                    for _, w in pairs
                    if w["step"] in previous
                ]
            ),
        }
    return out


def bandwidth_floor(weight_bytes: int, device: int = 0) -> dict[str, Any]:
    """A decode step at batch 1 reads every weight once: bytes over the measured copy bandwidth (a 1 GiB
    device-to-device copy, read + write) and over the spec bandwidth of the card."""
    name = torch.cuda.get_device_name(device)
    spec = next((bw for key, bw in SPEC_BANDWIDTH.items() if key in name), None)
    nbytes = 1 << 30
    with torch.cuda.device(device):
        source = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        target = torch.empty_like(source)
        target.copy_(source)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del source, target
        torch.cuda.empty_cache()
    measured = 2 * nbytes / (statistics.median(times) * 1e-3)
    return {
        "device": name,
        "weight_bytes": weight_bytes,
        "copy_bandwidth_GBps": round(measured / 1e9, 1),
        "floor_ms_measured_bandwidth": round(weight_bytes / measured * 1e3, 3),
        "spec_bandwidth_GBps": spec and round(spec / 1e9),
        "floor_ms_spec_bandwidth": spec and round(weight_bytes / spec * 1e3, 3),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _load(data: dict[str, Any], server: str, phase: str) -> dict[str, Any]:
    return data["servers"].get(server, {}).get("loads", {}).get(phase, {})


def _timeline(data: dict[str, Any], server: str, phase: str) -> dict[str, Any]:
    timeline = data["servers"].get(server, {}).get("timeline", {})
    return timeline.get(phase, {}) if isinstance(timeline, dict) else {}


def _itl(data: dict[str, Any], server: str, phase: str = "c1") -> float | None:
    """A request's time per output token, median over requests (``tpot_ms``: (last token - first token)
    / (tokens - 1)): the ITL a client sees, and unlike the median of single gaps it does not drop when a
    busy event loop sends a few tokens in one burst."""
    return _load(data, server, phase).get("tpot_ms", {}).get("p50")


def _tokens_per_s(data: dict[str, Any], server: str, phase: str) -> float | None:
    return _load(data, server, phase).get("output_tokens_per_s")


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: what, the value, the bound, met (None where the figure is missing)."""
    rows: list[dict[str, Any]] = []

    def add(what: str, value: float | None, bound: float, at_most: bool = True) -> None:
        met = None if value is None else (value <= bound if at_most else value >= bound)
        rows.append(
            {"what": what, "value": value, "bound": ("<= " if at_most else ">= ") + str(bound), "met": met}
        )

    add(
        "small: --tp 2 ITL (TPOT p50) at c=1 / one GPU's",
        _ratio(_itl(data, "small_tp2"), _itl(data, "small_tp1")),
        1.1,
    )
    add(
        "8b: --tp 2 ITL (TPOT p50) at c=1 / one GPU's",
        _ratio(_itl(data, "8b_tp2"), _itl(data, "8b_tp1")),
        0.6,
    )
    add(
        "8b: --tp 2 output tokens/s at c=64 / one GPU's",
        _ratio(_tokens_per_s(data, "8b_tp2", "c64"), _tokens_per_s(data, "8b_tp1", "c64")),
        1.6,
        at_most=False,
    )
    floor = data.get("floor", {}).get("floor_ms_spec_bandwidth") or data.get("floor", {}).get(
        "floor_ms_measured_bandwidth"
    )
    add("8b: one GPU's ITL (TPOT p50) at c=1 / the bandwidth floor", _ratio(_itl(data, "8b_tp1"), floor), 1.3)
    for server in (name for name, entry in data["servers"].items() if "loads" in entry):
        step = _timeline(data, server, "c1").get("decode_device_ms", {}).get("p50")
        add(
            f"{server}: ITL (TPOT p50) at c=1 / the decode step's device time (host share)",
            _ratio(_itl(data, server), step),
            1.03,
        )
        idle = _timeline(data, server, "c32").get("idle_share")
        add(f"{server}: device idle between steps at c=32 (share)", idle, 0.05)
    return rows
