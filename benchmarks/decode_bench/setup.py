"""The model, its sdpa twin (the same weight and cache tensors, the attention a break op) and every batch,
made in a fixed order so each process gets the same blocks; the eager references."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from harness.cases import KVPlan
from harness.device import Batch, Device

from decode_bench.plan import Plan, decode_case, prefill_case
from devgraph import forward_context
from devgraph.reference import ReferenceConfig, ReferenceModel, StepContext, batch_context

__all__ = ["Setup", "attention_twin", "build_setup"]


def attention_twin(model: ReferenceModel, attention: str) -> ReferenceModel:
    """The same model (the very same weight and cache tensors) with another attention."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, shared)
    twin.config = dataclasses.replace(model.config, attention=attention)
    for layer in twin.layers:
        layer.attention = attention
    if twin.layers[0].k_cache is not model.layers[0].k_cache or twin.embed is not model.embed:
        raise RuntimeError("the attention twin must share the model's tensors")
    return twin


@dataclass
class Setup:
    plan: Plan
    dev: Device
    models: dict[str, ReferenceModel]  # attention -> model
    batches: dict[str, dict[str, Batch]]  # phase -> case -> batch
    contexts: dict[str, dict[str, StepContext]] = field(default_factory=dict)
    refs: dict[str, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)  # phase/attn/case
    build_s: float = 0.0

    @property
    def paged(self) -> ReferenceModel:
        return self.models["paged"]

    def forward(self, phase: str, attention: str) -> Callable[..., torch.Tensor]:
        model = self.models[attention]
        return {"decode": model.decode_step, "prefill": model.prefill_step, "verify": model.verify_step}[
            phase
        ]

    def eager(self, phase: str, attention: str, case: str) -> torch.Tensor:
        context = self.contexts[phase][case] if attention == "sdpa" else None
        with forward_context(context):
            return self.forward(phase, attention)(**self.batches[phase][case])

    def compute_refs(self) -> None:
        for phase, cases in self.batches.items():
            for attention in self.models if phase != "verify" else ("paged",):
                self.refs.setdefault(phase, {})[attention] = {
                    case: self.eager(phase, attention, case).clone() for case in cases
                }
        self.dev.sync()


def build_setup(
    plan: Plan,
    device: torch.device,
    *,
    layers: int | None = None,
    phases: Sequence[str] = ("decode", "prefill", "verify"),
    refs: bool = True,
) -> Setup:
    """Model (+ sdpa twin), random cache, every batch made in a fixed order (the same blocks in every
    process), then only ``phases`` kept; eager references unless ``refs=False``."""
    t0 = time.perf_counter()
    overrides: dict[str, Any] = {"attention": "paged"}
    layers = layers if layers is not None else plan.layers
    if layers is not None:
        overrides["num_layers"] = layers
    if plan.max_requests is not None:
        overrides["max_requests"] = plan.max_requests
    base = ReferenceConfig.preset(plan.preset, **overrides)
    kv = KVPlan(base, plan.private_blocks)
    model = ReferenceModel(kv.config(base), device=device, seed=0)
    model.randomize_cache(seed=1)
    models = {"paged": model, "sdpa": attention_twin(model, "sdpa")}
    seed = iter(range(10_000))
    batches: dict[str, dict[str, Batch]] = {"decode": {}, "prefill": {}, "verify": {}}
    for context in plan.contexts:
        for b in plan.decode_batches:
            batches["decode"][decode_case(b, context)] = kv.decode(model, b, context, next(seed))
    for lens in plan.prefill_cases:
        batches["prefill"][prefill_case(lens)] = kv.prefill(model, lens, None, next(seed))
    tpr = plan.draft_tokens + 1
    for b in plan.verify_batches:
        prefixes = [plan.verify_context - tpr] * b
        batches["verify"][decode_case(b, plan.verify_context)] = kv.prefill(
            model, [tpr] * b, prefixes, next(seed)
        )
    batches = {phase: batches[phase] for phase in phases}
    setup = Setup(plan, Device(device), models, batches)
    setup.contexts = {
        phase: {c: batch_context(b) for c, b in cases.items()} for phase, cases in batches.items()
    }
    if refs:
        setup.compute_refs()
    setup.build_s = time.perf_counter() - t0
    return setup
