"""Where the served model comes from: a random-weight preset, or a Hugging Face checkpoint directory.

``--model`` names either. Start-up asks the source three things, in this order, so the arguments can be
checked and the KV cache sized before any weight is allocated:

1. :meth:`ModelSource.model_config`: the reference model's shape with the server's limits
   (running requests, context, KV blocks, dtype, attention) applied; a context longer than the checkpoint
   serves exactly is refused here;
2. :meth:`ModelSource.build`: the model on its device, weights drawn (preset) or loaded (checkpoint);
3. ``tokenizer`` and ``generation``: text in and out, stop ids, sampling defaults.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.messages import shorten
from devgraph.reference.config import PRESET_NAMES, ReferenceConfig, parse_dtype
from devgraph.reference.model import ReferenceModel
from devgraph.serve.checkpoint.byte_tokenizer import ByteTokenizer
from devgraph.serve.checkpoint.generation import GenerationDefaults, read_generation_config
from devgraph.serve.checkpoint.hf_config import CheckpointConfig, read_checkpoint_config
from devgraph.serve.checkpoint.template_render import RenderLimits
from devgraph.serve.checkpoint.text import Tokenizer
from devgraph.serve.checkpoint.weights import WeightFiles, load_weights

__all__ = ["DEFAULT_CHECKPOINT_CONTEXT", "Built", "ModelSource", "open_model"]

logger = logging.getLogger(__name__)

#: A checkpoint's context unless --max-seq-len says otherwise (its own limit when that is shorter): the
#: KV cache holds every running request at full length, so a 40k-token default would not fit.
DEFAULT_CHECKPOINT_CONTEXT = 2048
MiB = float(1 << 20)


@dataclass
class Built:
    """A model on its device and what building it took."""

    model: ReferenceModel
    seconds: float
    weight_bytes: int
    how: str  # "random weights (seed 0)" or "loaded 311 tensors from DIR"


@dataclass
class ModelSource:
    """A preset (``checkpoint is None``) or a checkpoint directory, read but not yet built."""

    name: str
    tokenizer: Tokenizer
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    checkpoint: CheckpointConfig | None = None
    directory: Path | None = None
    files: WeightFiles | None = None

    @property
    def is_preset(self) -> bool:
        return self.checkpoint is None

    def describe(self) -> str:
        if self.checkpoint is None:
            return f"preset {self.name!r}, random weights"
        return f"{self.checkpoint.architecture} from {self.directory}"

    def model_config(self, overrides: dict[str, Any]) -> ReferenceConfig:
        """The reference model's config with ``overrides`` (ReferenceConfig fields, ``None`` = unset)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if self.checkpoint is None:
            return ReferenceConfig.preset(self.name, **given)
        fields = dict(self.checkpoint.model_fields)
        limit, reason = self.checkpoint.context_limit, self.checkpoint.context_reason
        context = given.pop("max_seq_len", None)
        if context is not None and context > limit:
            raise ConfigError(
                f"--max-seq-len {context} is longer than this checkpoint is served exactly: {reason} "
                f"limits it to {limit}; give --max-seq-len {limit} or less"
            )
        fields["max_seq_len"] = context if context is not None else min(limit, DEFAULT_CHECKPOINT_CONTEXT)
        if isinstance(given.get("dtype"), str):
            given["dtype"] = parse_dtype(given["dtype"])
        fields.update(given)
        return ReferenceConfig(**fields)

    def build(
        self,
        config: ReferenceConfig,
        device: torch.device,
        seed: int,
        progress: bool | None = None,
        group: Any = None,
    ) -> Built:
        """The model on ``device``: random weights from ``seed`` (preset) or the checkpoint's weights.
        ``group``: a tensor-parallel process group; the model is then this rank's shard of it."""
        start = time.perf_counter()
        model: ReferenceModel
        if group is not None:
            model = _tp_model(config, group, device, seed, "random" if self.files is None else "empty")
        if self.files is None:
            if group is None:
                model = ReferenceModel(config, device=device, seed=seed)
            how = f"random weights (seed {seed})"
        else:
            if group is None:
                model = ReferenceModel(config, device=device, weights="empty")
            report = load_weights(model, self.files, progress)
            how = f"loaded {report.tensors} tensors ({report.bytes / MiB:.1f} MiB) from {self.directory}"
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return Built(model, time.perf_counter() - start, weights, how)


#: Environment variable: how a ``--tp`` server's ranks all-reduce (``auto``, ``torch``, ``op`` or ``symm``:
#: :mod:`devgraph.reference.tp.comm`); read by every rank, so the server and its workers agree.
TP_COMM_ENV = "DEVGRAPH_TP_COMM"
#: Environment variable: ``0`` keeps a ``symm`` server's all-reduces apart from the residual add and norm
#: after them (``TPReferenceModel(fuse_all_reduce=False)``); ``1`` (default) fuses them where Triton runs.
TP_FUSE_ENV = "DEVGRAPH_TP_FUSE"


def _tp_model(config: ReferenceConfig, group: Any, device: torch.device, seed: int, weights: str) -> Any:
    from devgraph.reference.tp import TPReferenceModel  # only a --tp server needs it
    from devgraph.reference.tp.comm import COMM_MODES

    comm = os.environ.get(TP_COMM_ENV, "").strip().lower() or "auto"
    if comm not in COMM_MODES:
        raise ConfigError(f"{TP_COMM_ENV}={shorten(comm)} is unknown; accepted: {', '.join(COMM_MODES)}")
    fuse = os.environ.get(TP_FUSE_ENV, "").strip() or "1"
    if fuse not in ("0", "1"):
        raise ConfigError(f"{TP_FUSE_ENV}={shorten(fuse)} is unknown; accepted: 0 (apart) or 1 (fused)")
    # exact_weights: a preset's shards are drawn as the single-device model draws (equal tokens).
    return TPReferenceModel(
        config,
        group,
        device,
        seed,
        exact_weights=True,
        weights=weights,
        comm=comm,
        fuse_all_reduce=fuse == "1",
    )


def open_model(
    value: str,
    chat_template: Path | None = None,
    *,
    trust_request_template: bool = False,
    render_limits: RenderLimits | None = None,
) -> ModelSource:
    """The source ``--model`` names: a preset name, or a checkpoint directory (config, generation config
    and tokenizer read; weights located, not loaded). :class:`ConfigError` for anything else, naming the
    file at fault. ``trust_request_template``: chat templates sent in requests are rendered
    (``--trust-request-chat-template``); ``render_limits``: what one render may take."""
    path = Path(value).expanduser()
    if value in PRESET_NAMES and not path.is_dir():
        if chat_template is not None:
            raise ConfigError("--chat-template needs a checkpoint (--model DIR); a preset has no tokenizer")
        return ModelSource(value, ByteTokenizer())
    if not path.is_dir():
        raise ConfigError(
            f"--model {shorten(value)} is neither a preset ({', '.join(PRESET_NAMES)}) nor a checkpoint "
            "directory; give a local Hugging Face checkpoint directory (config.json, *.safetensors, "
            "tokenizer files)"
        )
    files = WeightFiles.find(path)
    checkpoint = read_checkpoint_config(path, files.stored_dtype())
    for note in checkpoint.notes:
        logger.info("%s: %s", path.name, note)
    template = _read_template(chat_template)
    from devgraph.serve.checkpoint.hf_tokenizer import HFTokenizer  # imports transformers: only here

    tokenizer = HFTokenizer(
        path, template, trust_request_template=trust_request_template, render_limits=render_limits
    )
    generation = read_generation_config(path, checkpoint.eos_token_ids, tokenizer.eos_token_ids)
    for note in generation.notes:
        logger.warning("%s: %s", path.name, note)
    fields = checkpoint.model_fields
    features = [name for name in ("qkv_bias", "qk_norm", "tie_embeddings") if fields[name]]
    logger.info(
        "checkpoint %s: %s, %s, %d layers, vocab %d, %s, RoPE %s; tokenizer of %d tokens, %s chat template; "
        "stop ids %s; sampling defaults %s",
        path,
        checkpoint.architecture,
        str(checkpoint.dtype).removeprefix("torch."),
        fields["num_layers"],
        fields["vocab_size"],
        ", ".join(features) or "no extra features",
        fields["rope_scaling"].kind,
        tokenizer.vocab_size,
        "a" if tokenizer.has_chat_template else "no",
        list(generation.eos_token_ids),
        generation.sampling() or "none",
    )
    return ModelSource(value, tokenizer, generation, checkpoint, path, files)


def _read_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--chat-template {path}: {exc.strerror or exc}") from None
