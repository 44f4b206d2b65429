"""Loading a checkpoint's safetensors into the reference model, one tensor at a time.

The model is built with its weights allocated but unwritten (``ReferenceModel(..., weights="empty")``);
each tensor of the checkpoint is then read lazily (``safe_open``: only that tensor's bytes leave the
file; under ``--tp`` only this rank's rows or columns of it), checked against the slot it fills,
converted to the model's dtype and copied to the model's device.
Transformers' separate projections land in the reference model's fused ones: ``q_proj``, ``k_proj`` and
``v_proj`` (and their biases) in ``qkv_proj``; ``gate_proj`` and ``up_proj`` in ``gate_up_proj``; Qwen3's
``q_norm`` and ``k_norm`` in the per-head scale ``qk_norm`` (one row per query head, then per KV head).

Every tensor the model needs must be there, and every tensor there must be used (a rotary embedding's
cached ``inv_freq``, and the LM head of a model whose embeddings are tied, are the known leftovers):
anything else means the config and the weights disagree, and start-up stops naming the tensors.
Progress: a bar on a terminal, otherwise an INFO line every quarter of the bytes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from devgraph import ConfigError
from devgraph.extras import require_extra
from devgraph.jsonfile import read_json_file
from devgraph.messages import shorten
from devgraph.reference.model import DecoderLayer, ReferenceModel

__all__ = ["LoadReport", "WeightFiles", "load_weights"]

logger = logging.getLogger(__name__)

MiB = float(1 << 20)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class WeightFiles:
    """Which file holds each tensor of a checkpoint (one file, or a sharded index)."""

    directory: Path
    where: dict[str, str]  # tensor name -> file name

    @classmethod
    def find(cls, directory: Path) -> WeightFiles:
        """The checkpoint's safetensors files, each opened once to read its header; :class:`ConfigError`
        naming the file when there are none, the index is damaged, a shard is missing or a file is not
        readable safetensors (truncated, overwritten, empty)."""
        index = directory / "model.safetensors.index.json"
        if index.exists():
            sharded = _read_index(index)
            for name in sorted(set(sharded.values())):
                with _open(directory / name):  # a missing or damaged shard stops start-up here
                    pass
            return cls(directory, sharded)
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            other = sorted(
                p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")
            )
            found = f" (it has {', '.join(other[:3])})" if other else ""
            raise ConfigError(
                f"{directory} has no *.safetensors weights{found}: devgraph serve loads safetensors only; "
                "save the model with save_pretrained(safe_serialization=True)"
            )
        where: dict[str, str] = {}
        for name in files:
            with _open(directory / name) as handle:
                where.update(dict.fromkeys(handle.keys(), name))
        if not where:
            raise ConfigError(f"{directory}: its safetensors files ({', '.join(files[:3])}) hold no tensors")
        return cls(directory, where)

    def stored_dtype(self) -> torch.dtype | None:
        """The dtype the floating-point tensors are stored in (the first one's), if it is a float type."""
        name, file = next(iter(self.where.items()))
        with _open(self.directory / file) as handle:
            return _SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype())


def _read_index(index: Path) -> dict[str, str]:
    """``weight_map`` of a sharded checkpoint's index: tensor name -> a file name in the same directory."""
    data = read_json_file(index, "a safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(
            f"{index}: weight_map must be a non-empty object of tensor name -> shard file, got "
            f"{shorten(weight_map)}; the index is damaged: copy it again with the checkpoint"
        )
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise ConfigError(
                f"{index}: tensor {shorten(tensor)} is mapped to {shorten(file)}, not a file name in the "
                "checkpoint directory"
            )
    missing = sorted({f for f in weight_map.values() if not (index.parent / f).is_file()})
    if missing:
        raise ConfigError(
            f"{index} names {len(missing)} shard(s) missing from {index.parent}: {shorten(missing, 200)}; "
            "copy every shard of the checkpoint"
        )
    return {str(k): v for k, v in weight_map.items()}


@contextlib.contextmanager
def _open(path: Path) -> Iterator[Any]:
    """``safe_open(path)``; :class:`ConfigError` naming the file when it cannot be opened or read."""
    safe_open = _safe_open()
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors' own error type, an OSError: the file is not usable as it is
        raise ConfigError(f"{path}: {_unreadable(exc)}") from None
    with handle:
        yield handle


def _unreadable(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc})"
    reason = " ".join(str(exc).split()).removeprefix("Error while deserializing header: ")
    return (
        f"not a readable safetensors file ({shorten(reason, 120)}): it is truncated, empty or overwritten; "
        "copy it again"
    )


@dataclass(frozen=True)
class LoadReport:
    tensors: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes: ``target`` (a view of a model weight) and the shape it must have."""

    target: torch.Tensor
    shape: tuple[int, ...]
    #: This rank's part of the checkpoint tensor (tensor parallelism): (dim, range) read alone from the
    #: file, the rest never leaves it; None: all of it.
    part: tuple[int, slice] | None = None


def _slots(model: ReferenceModel) -> dict[str, _Slot]:
    if getattr(model, "comm", None) is not None:  # a TPReferenceModel: each rank loads its slices
        return _tp_slots(model)
    c = model.config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    slots: dict[str, _Slot] = {}

    def put(name: str, target: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
        slots[name] = _Slot(target, tuple(target.shape) if shape is None else shape)

    put("model.embed_tokens.weight", model.embed.data)
    put("model.norm.weight", model.norm.weight.data)
    if model.lm_head is not None:
        put("lm_head.weight", model.lm_head.data)
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        prefix = f"model.layers.{i}."
        put(prefix + "input_layernorm.weight", layer.input_norm.weight.data)
        put(prefix + "post_attention_layernorm.weight", layer.post_attention_norm.weight.data)
        parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        for part, rows in parts.items():
            put(f"{prefix}self_attn.{part}.weight", layer.qkv_proj.data[rows])
            if layer.qkv_bias is not None:
                put(f"{prefix}self_attn.{part}.bias", layer.qkv_bias.data[rows])
        put(prefix + "self_attn.o_proj.weight", layer.o_proj.data)
        if layer.qk_norm is not None:  # one [head_dim] scale fills every row of its heads
            scale = layer.qk_norm.weight.data
            put(prefix + "self_attn.q_norm.weight", scale[: c.num_heads], (c.head_dim,))
            put(prefix + "self_attn.k_norm.weight", scale[c.num_heads :], (c.head_dim,))
        put(prefix + "mlp.gate_proj.weight", layer.gate_up_proj.data[:inter])
        put(prefix + "mlp.up_proj.weight", layer.gate_up_proj.data[inter:])
        put(prefix + "mlp.down_proj.weight", layer.down_proj.data)
    return slots


def _tp_slots(model: ReferenceModel) -> dict[str, _Slot]:
    """Megatron-style slices for one tensor-parallel rank: column-parallel projections (q/k/v, gate/up,
    an untied LM head) keep this rank's output rows, row-parallel ones (o_proj, down_proj) its input
    columns; the embedding and the norms are whole. The shape checked is the checkpoint's full one."""
    c = model.config
    comm: Any = model.comm
    rank, size = int(comm.rank), int(comm.world_size)
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    slots: dict[str, _Slot] = {}

    def part(total: int) -> slice:
        return slice(rank * total // size, (rank + 1) * total // size)

    def rows(total: int) -> tuple[int, slice]:
        return 0, part(total)

    def columns(total: int) -> tuple[int, slice]:
        return 1, part(total)

    def put(name: str, target: torch.Tensor, shape: tuple[int, ...], part: Any = None) -> None:
        slots[name] = _Slot(target, shape, part)

    hidden = c.hidden_size
    put("model.embed_tokens.weight", model.embed.data, (c.vocab_size, hidden))
    put("model.norm.weight", model.norm.weight.data, (hidden,))
    if model.lm_head is not None:
        put("lm_head.weight", model.lm_head.data, (c.vocab_size, hidden), rows(c.vocab_size))
    q_local, kv_local, inter_local = q // size, kv // size, inter // size
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        prefix = f"model.layers.{i}."
        put(prefix + "input_layernorm.weight", layer.input_norm.weight.data, (hidden,))
        put(prefix + "post_attention_layernorm.weight", layer.post_attention_norm.weight.data, (hidden,))
        local = {"q_proj": slice(0, q_local), "k_proj": slice(q_local, q_local + kv_local)}
        local["v_proj"] = slice(q_local + kv_local, q_local + 2 * kv_local)
        for name, full in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            put(
                f"{prefix}self_attn.{name}.weight",
                layer.qkv_proj.data[local[name]],
                (full, hidden),
                rows(full),
            )
            if layer.qkv_bias is not None:
                put(f"{prefix}self_attn.{name}.bias", layer.qkv_bias.data[local[name]], (full,), rows(full))
        if layer.qk_norm is not None:  # one [head_dim] scale fills every row of this rank's heads
            scale, heads = layer.qk_norm.weight.data, c.num_heads // size
            put(prefix + "self_attn.q_norm.weight", scale[:heads], (c.head_dim,))
            put(prefix + "self_attn.k_norm.weight", scale[heads:], (c.head_dim,))
        put(prefix + "self_attn.o_proj.weight", layer.o_proj.data, (hidden, q), columns(q))
        gate_up = layer.gate_up_proj.data
        put(prefix + "mlp.gate_proj.weight", gate_up[:inter_local], (inter, hidden), rows(inter))
        put(prefix + "mlp.up_proj.weight", gate_up[inter_local:], (inter, hidden), rows(inter))
        put(prefix + "mlp.down_proj.weight", layer.down_proj.data, (hidden, inter), columns(inter))
    return slots


def _ignorable(name: str, model: ReferenceModel) -> bool:
    if name.endswith("rotary_emb.inv_freq"):  # a cached buffer some checkpoints carry
        return True
    return name == "lm_head.weight" and model.lm_head is None  # tied: the embedding is the head


def load_weights(model: ReferenceModel, files: WeightFiles, progress: bool | None = None) -> LoadReport:
    """Fill ``model`` from ``files``; :class:`ConfigError` naming missing, unexpected or misshapen tensors.

    ``progress``: a bar (default: when stderr is a terminal), else an INFO line per quarter of the bytes.
    """
    slots = _slots(model)
    missing = sorted(set(slots) - set(files.where))
    unexpected = sorted(n for n in set(files.where) - set(slots) if not _ignorable(n, model))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) the config implies: {shorten(missing[:6], 300)}")
        if unexpected:
            parts.append(
                f"{len(unexpected)} tensor(s) the config has no place for: {shorten(unexpected[:6], 300)}"
            )
        raise ConfigError(
            f"the weights in {files.directory} do not match its config.json ({'; '.join(parts)}); "
            "the checkpoint may be incomplete or of another architecture"
        )
    start = time.perf_counter()
    total = sum(s.target.numel() * s.target.element_size() for s in slots.values())
    done = 0
    with torch.no_grad(), _Progress(total, progress) as bar:
        for name, shape, tensor in _read(files, slots):
            slot = slots[name]
            if shape != slot.shape:
                raise ConfigError(
                    f"{files.directory / files.where[name]}: tensor {name} has shape {shape}, "
                    f"the config implies {slot.shape}"
                )
            slot.target.copy_(tensor().expand_as(slot.target))
            size = slot.target.numel() * slot.target.element_size()
            done += size
            bar.advance(size, done)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return LoadReport(len(slots), total, time.perf_counter() - start)


def _read(
    files: WeightFiles, slots: dict[str, _Slot]
) -> Iterator[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """``(name, full shape, read)`` for every slot, file by file: ``read()`` reads the slot's part of the
    tensor (all of it, or this rank's rows or columns) from the memory-mapped file, nothing else. A tensor
    the header names but the file does not hold as named is a :class:`ConfigError` naming the file."""
    by_file: dict[str, list[str]] = {}
    for name in slots:
        by_file.setdefault(files.where[name], []).append(name)
    for file, names in sorted(by_file.items()):
        path = files.directory / file
        with _open(path) as handle:
            for name in names:
                try:
                    stored = handle.get_slice(name)
                    shape = tuple(stored.get_shape())
                except Exception as exc:  # a tensor the header names but the file does not hold as named
                    raise ConfigError(f"{path}: tensor {name}: {_unreadable(exc)}") from None
                part = slots[name].part
                if part is None:
                    read = functools.partial(handle.get_tensor, name)
                else:
                    index = (part[1],) if part[0] == 0 else (slice(None), part[1])
                    read = functools.partial(stored.__getitem__, index)
                yield name, shape, functools.partial(_checked_read, read, path, name)


def _checked_read(read: Callable[[], torch.Tensor], path: Path, name: str) -> torch.Tensor:
    try:
        return read()
    except Exception as exc:  # the data past the header is short or unreadable
        raise ConfigError(f"{path}: tensor {name}: {_unreadable(exc)}") from None


def _safe_open() -> Callable[..., Any]:
    module = require_extra("safetensors", extra="serve", needed_by="loading a checkpoint's weights")
    return module.safe_open  # type: ignore[no-any-return]


class _Progress:
    """A tqdm bar over bytes on a terminal; otherwise an INFO line at each quarter."""

    def __init__(self, total: int, show: bool | None) -> None:
        self.total = max(total, 1)
        self.show = sys.stderr.isatty() if show is None else show
        self.bar: Any = None
        self.next_quarter = 1
        self.start = time.perf_counter()

    def __enter__(self) -> _Progress:
        if self.show:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc="loading weights", leave=False)
        return self

    def advance(self, size: int, done: int) -> None:
        if self.bar is not None:
            self.bar.update(size)
            return
        while self.next_quarter <= 4 and done * 4 >= self.next_quarter * self.total:
            logger.info(
                "loaded %d%% of the weights (%.0f MiB) in %.1f s",
                25 * self.next_quarter,
                done / MiB,
                time.perf_counter() - self.start,
            )
            self.next_quarter += 1

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
