"""What the checks run: the kit's reference model, decode batches with chosen KV blocks, cache snapshots
and the small forwards (a closure over state, a break op, a step counter, a host sync)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from devgraph import GraphKey, GraphRunner, StaticInput, forward_context
from devgraph.reference import ReferenceConfig, ReferenceModel, reference_inputs
from devgraph.testing._kit import KitContext
from devgraph.testing._ops import context_scale

__all__ = [
    "KIT_MODEL_CONFIG",
    "WIDTH",
    "BreakContext",
    "Holder",
    "StaticBreakContext",
    "block_batch",
    "break_forward",
    "changed_blocks",
    "counter_forward",
    "eager_break",
    "eager_step",
    "feature_input",
    "kit_model",
    "padding_problems",
    "reference_runner",
    "snapshot_caches",
    "sync_forward",
]

#: The reference model the kit captures: one layer, tiny shapes, float32, the torch attention kernels
#: (device metadata only, so ``full`` captures attention whole and every strategy traces it).
KIT_MODEL_CONFIG = ReferenceConfig.preset(
    "tiny",
    vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
    max_requests=16,
    max_seq_len=32,
    block_size=16,
    kernels="torch",
)
#: Feature width of the kit's small forwards.
WIDTH = 8


# -- the reference model -----------------------------------------------------------------------------
def kit_model(ctx: KitContext, seed: int = 0) -> ReferenceModel:
    """The kit's model with a random KV cache; enough requests for a step past the largest size."""
    config = dataclasses.replace(
        KIT_MODEL_CONFIG, max_requests=max(KIT_MODEL_CONFIG.max_requests, 2 * ctx.sizes[-1] + 4)
    )
    model = ReferenceModel(config, device=ctx.device, seed=seed)
    model.randomize_cache(seed=seed)
    return model


def reference_runner(ctx: KitContext, model: ReferenceModel, **kwargs: Any) -> GraphRunner:
    """A runner over the model's decode step in the kit's phase. The logits are declared row-major on the
    tokens axis, so no phase needs the runner to probe the layout (a probe of a prefill-phase runner
    would pair token and request counts a decode step cannot take)."""
    kwargs.setdefault("output_axes", ["tokens"])
    return ctx.runner(model.decode_step, reference_inputs(model, "decode"), **kwargs)


def block_batch(model: ReferenceModel, blocks: Sequence[int], *, seed: int) -> dict[str, Any]:
    """A decode batch whose request ``r`` owns exactly KV block ``blocks[r]`` (lengths within one block),
    so a check knows every cache slot a step may write."""
    config = model.config
    if 0 in blocks or len(set(blocks)) != len(blocks) or max(blocks) >= config.total_blocks:
        raise ValueError(f"blocks {list(blocks)} must be distinct, non-zero and < {config.total_blocks}")
    generator = torch.Generator().manual_seed(seed)
    count = len(blocks)
    lens = torch.randint(1, config.block_size + 1, (count,), generator=generator)
    tables = torch.zeros((count, config.max_blocks_per_request), dtype=torch.int32)
    tables[:, 0] = torch.tensor(list(blocks), dtype=torch.int32)
    positions = lens - 1
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (count,), generator=generator),
        "positions": positions,
        "slot_mapping": tables[:, 0].long() * config.block_size + positions,
        "block_tables": tables,
        "seq_lens": lens.int(),
    }
    return {name: t.to(model.device) for name, t in batch.items()}


def free_blocks(model: ReferenceModel, seed: int) -> list[int]:
    """Every block but the scratch block 0, in a seeded random order."""
    order = torch.randperm(model.config.total_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    return [int(b) for b in order]


def eager_step(model: ReferenceModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad(), forward_context(None):
        return model.decode_step(**batch)


def snapshot_caches(model: ReferenceModel) -> list[torch.Tensor]:
    """A copy of every layer's K and V cache."""
    return [c.detach().clone() for c in (*model.k_cache, *model.v_cache)]


def changed_blocks(before: Sequence[torch.Tensor], model: ReferenceModel) -> set[int]:
    """KV blocks whose contents differ from ``before`` in any layer's K or V cache."""
    changed: set[int] = set()
    for old, new in zip(before, (*model.k_cache, *model.v_cache), strict=True):
        differs = (old != new).flatten(1).any(dim=1)
        changed.update(int(b) for b in torch.arange(differs.numel())[differs.cpu()])
    return changed


def padding_problems(
    runner: GraphRunner, key: GraphKey, counts: Mapping[str, int], names: Iterable[str] | None = None
) -> list[str]:
    """Inputs whose padding rows (past the real count, up to ``key``) do not hold the input's fill."""
    problems = []
    for name, spec in runner.input_specs.items():
        if names is not None and name not in names:
            continue
        buf = runner.static_inputs[name]
        real, padded = spec.rows(counts[spec.axis]), spec.rows(key.size(spec.axis))
        pad = buf[real:padded]
        fill = spec.fill
        want = buf[real - 1 : real].expand_as(pad) if isinstance(fill, str) else torch.full_like(pad, fill)
        if not torch.equal(pad, want):
            problems.append(
                f"{name} rows {real}..{padded - 1} hold {pad.tolist()}, not the fill {spec.fill!r}"
            )
    return problems


# -- small forwards ----------------------------------------------------------------------------------
def feature_input() -> dict[str, StaticInput]:
    return {"x": StaticInput(torch.float32, (WIDTH,))}


class Holder(torch.nn.Module):
    """Model state read through the closure (not a runner input), like an engine's weights or caches."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


@dataclass
class BreakContext:
    """The forward context the kit hands to ``run``: the break op reads ``factor``."""

    factor: float


@dataclass
class StaticBreakContext(BreakContext):
    """A :class:`BreakContext` whose ``factor`` is declared static: a graph that captured the break op keeps
    the capture's factor on purpose, and the runner's host-value check leaves it alone."""

    __devgraph_static__ = ("factor",)


def break_forward(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = context_scale(torch.tanh(x @ weight))
        return y * 2.0 + 1.0

    return forward


def eager_break(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, factor: float) -> Any:
    with torch.no_grad(), forward_context(BreakContext(factor)):
        return forward(x)


def counter_forward(counter: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward that is not idempotent: each call advances ``counter`` (model state in the closure)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        counter.add_(1.0)
        return x * counter

    return forward


def sync_forward(fail_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x * 2``, plus a host sync (``.item()``) when the step has ``fail_size`` rows."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        if x.shape[0] == fail_size:
            y = y + float(y.sum().item())  # a host sync: not capturable
        return y

    return forward
