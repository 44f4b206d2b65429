"""A Hugging Face checkpoint's ``config.json``, read into the reference model's shape or refused.

The families served are the decoders the reference model expresses exactly: Llama (2 and 3, RoPE
scaling ``linear`` and ``llama3``), Qwen2 (biases on q, k and v), Qwen3 (per-head q/k RMSNorm) and
Mistral, each with tied or untied embeddings, SiLU MLPs and full attention. Everything else is refused
before a byte of weights is read, with every reason at once: another architecture (MoE, custom code via
``auto_map``), quantized weights, another activation, attention or MLP biases the family does not have,
RoPE types whose frequencies follow the running sequence length or rescale attention (``yarn``,
``longrope``, ...), partial rotary dimensions.

Two features are served exactly inside a bound, which becomes a limit on the context:

* a sliding attention window: attention over the last ``W`` positions equals full attention while a
  sequence holds at most ``W`` tokens;
* ``dynamic`` (NTK) RoPE: transformers uses the default frequencies until a sequence passes
  ``max_position_embeddings``.

Both Hugging Face formats are read: transformers 5 (``rope_parameters``, ``dtype``, ``layer_types``) and
4 (``rope_theta`` + ``rope_scaling``, ``torch_dtype``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from devgraph import ConfigError
from devgraph.jsonfile import read_json_file
from devgraph.messages import kind, shorten
from devgraph.reference.config import parse_dtype
from devgraph.reference.rope import RopeScaling

__all__ = ["FAMILIES", "CheckpointConfig", "read_checkpoint_config", "token_ids"]

logger = logging.getLogger(__name__)

#: model_type -> the causal-LM class transformers builds for it.
FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
#: transformers' default RoPE base when a config names none.
DEFAULT_ROPE_THETA = 10000.0

# Keys that change nothing the forward computes (training, bookkeeping, token ids read elsewhere).
_INERT = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "use_cache", "initializer_range",
    "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
    "max_position_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "pretraining_tp", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "tokenizer_class",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tie_encoder_decoder", "pruned_heads", "task_specific_params", "finetuning_task", "prefix",
    "sep_token_id", "decoder_start_token_id", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "cross_attention_hidden_size", "num_labels", "bad_words_ids", "begin_suppress_tokens",
}  # fmt: skip


@dataclass(frozen=True)
class CheckpointConfig:
    """What ``config.json`` says, in the reference model's terms.

    ``model_fields``: :class:`~devgraph.reference.ReferenceConfig` fields (shapes, features, RoPE, dtype);
    ``context_limit``: the longest context the model is served exactly at (``max_position_embeddings``, or
    less when a sliding window or dynamic RoPE bounds it) and ``context_reason`` what sets it;
    ``eos_token_ids``: the config's own EOS ids (generation_config.json may name more).
    """

    family: str
    architecture: str
    model_fields: dict[str, Any]
    context_limit: int
    context_reason: str
    eos_token_ids: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def dtype(self) -> torch.dtype:
        return self.model_fields["dtype"]  # type: ignore[no-any-return]


def read_checkpoint_config(directory: Path, weights_dtype: torch.dtype | None = None) -> CheckpointConfig:
    """Read and check ``directory/config.json``; :class:`ConfigError` naming every unsupported feature.

    ``weights_dtype`` (the stored tensors' dtype) stands in when the config names no dtype or ``auto``.
    """
    path = directory / "config.json"
    if not path.exists():
        raise ConfigError(
            f"{directory} has no config.json: give --model a Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    raw = read_json_file(path, "a checkpoint's config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return _Reader(raw, path, weights_dtype).read()


class _Reader:
    def __init__(self, raw: dict[str, Any], path: Path, weights_dtype: torch.dtype | None) -> None:
        self.raw = raw
        self.path = path
        self.weights_dtype = weights_dtype
        self.problems: list[str] = []
        self.notes: list[str] = []

    def read(self) -> CheckpointConfig:
        family, architecture = self._family()
        fields = self._shapes()
        fields.update(
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            tie_embeddings=self._bool("tie_word_embeddings"),
            dtype=self._dtype(),
        )
        self._features()
        window = self._sliding_window(family)
        rope, theta, dynamic = self._rope(fields["head_dim"])
        fields.update(rope_theta=theta, rope_scaling=rope)
        if self.problems:
            listed = "; ".join(self.problems)
            raise ConfigError(
                f"{self.path.parent.name}: {architecture} is not served as configured: {listed}. "
                "devgraph serve runs Llama, Qwen2, Qwen3 and Mistral decoders with full attention, SiLU MLPs "
                "and default, linear or llama3 RoPE"
            )
        limit, reason = fields.pop("max_position_embeddings"), "max_position_embeddings"
        if window is not None and window < limit:
            limit, reason = window, "the sliding attention window"
        if dynamic is not None and dynamic < limit:
            limit, reason = dynamic, "dynamic RoPE (it rescales past this length)"
        unread = sorted(set(self.raw) - _INERT)
        if unread:
            self.notes.append(
                f"config.json fields devgraph does not read (inert for the served families): {unread}"
            )
        return CheckpointConfig(
            family,
            architecture,
            fields,
            limit,
            reason,
            token_ids(self.raw.get("eos_token_id")),
            tuple(self.notes),
        )

    # -- pieces ------------------------------------------------------------------------------------
    def _family(self) -> tuple[str, str]:
        model_type = self.raw.get("model_type")
        architectures = self.raw.get("architectures") or []
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ConfigError(
                f"{self.path}: architectures must be a list of class names, got {shorten(architectures)}"
            )
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            supported = ", ".join(f"{name} ({t})" for t, name in FAMILIES.items())
            named = ", ".join(map(str, architectures)) or "no architecture"
            raise ConfigError(
                f"{self.path.parent.name}: model_type {shorten(model_type)} ({named}) is not supported; "
                f"devgraph serve runs {supported}"
            )
        expected = FAMILIES[model_type]
        if architectures and architectures != [expected]:
            self.problems.append(f"architectures {architectures} (only {expected} is served)")
        if "auto_map" in self.raw:
            self.problems.append("auto_map (custom modelling code) is not run")
        if self.raw.get("quantization_config") is not None:
            method = self.raw["quantization_config"]
            method = method.get("quant_method", "?") if isinstance(method, dict) else method
            self.problems.append(f"quantization_config ({shorten(method)}): quantized weights are not loaded")
        return model_type, expected

    def _int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{self.path}: {name} must be a positive integer, got {shorten(value)} ({kind(value)})"
            )
        return value

    def _bool(self, name: str) -> bool:
        """A true/false field: JSON true or false (or absent: false); a string such as "false" is refused,
        where Python would read it as true."""
        value = self.raw.get(name, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ConfigError(
                f"{self.path}: {name} must be true or false, got {shorten(value)} ({kind(value)})"
            )
        return value

    def _shapes(self) -> dict[str, Any]:
        heads = self._int("num_attention_heads")
        hidden = self._int("hidden_size")
        head_dim = hidden // heads if self.raw.get("head_dim") is None else self._int("head_dim")
        eps = self.raw.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ConfigError(f"{self.path}: rms_norm_eps must be a number > 0, got {shorten(eps)}")
        return {
            "vocab_size": self._int("vocab_size"),
            "hidden_size": hidden,
            "num_layers": self._int("num_hidden_layers"),
            "num_heads": heads,
            "num_kv_heads": self._int("num_key_value_heads", heads),
            "head_dim": head_dim,
            "intermediate_size": self._int("intermediate_size"),
            "rms_eps": float(eps),
            "max_position_embeddings": self._int("max_position_embeddings", 2048),
        }

    def _dtype(self) -> torch.dtype:
        name = self.raw.get("dtype") or self.raw.get("torch_dtype")
        if name in (None, "auto"):
            return self.weights_dtype or torch.float32
        if not isinstance(name, str):
            raise ConfigError(f"{self.path}: dtype must be a name such as 'bfloat16', got {shorten(name)}")
        try:
            return parse_dtype(name)
        except ConfigError:
            self.problems.append(f"dtype {name!r} (float32, float16 and bfloat16 are served)")
            return torch.float32

    def _features(self) -> None:
        act = self.raw.get("hidden_act", "silu")
        if act != "silu":
            self.problems.append(f"hidden_act {shorten(act)} (only silu)")
        if self._bool("attention_bias"):
            self.problems.append(
                "attention_bias (biases on q, k, v and o; only Qwen2's q, k and v biases are served)"
            )
        if self._bool("mlp_bias"):
            self.problems.append("mlp_bias (biases in the MLP)")
        tp = self.raw.get("pretraining_tp", 1)
        if tp not in (None, 1):  # transformers 5 no longer splits the matmuls: the math is the same
            self.notes.append(f"pretraining_tp {tp} is a training detail; the projections are computed whole")

    def _sliding_window(self, family: str) -> int | None:
        """The attention window some layer uses, or None."""
        window = self.raw.get("sliding_window")
        layer_types = self.raw.get("layer_types")
        if layer_types is not None and (
            not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
        ):
            raise ConfigError(
                f"{self.path}: layer_types must be a list of attention kinds, one per layer, got "
                f"{shorten(layer_types)}"
            )
        if isinstance(layer_types, list):
            unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
            if unknown:
                self.problems.append(f"layer_types {unknown} (only full and sliding attention)")
            sliding = "sliding_attention" in layer_types
        elif family == "mistral":
            sliding = window is not None
        else:  # Qwen2/3 before layer_types: use_sliding_window switches it on
            sliding = self._bool("use_sliding_window")
        if not sliding:
            return None
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            self.problems.append(f"sliding_window {shorten(window)} (a positive integer is needed)")
            return None
        self.notes.append(
            f"sliding_window {window}: exact while a sequence holds at most {window} tokens, so the context "
            "is limited to it (sliding-window attention itself is not implemented)"
        )
        return window

    def _rope(self, head_dim: int) -> tuple[RopeScaling, float, int | None]:
        """The RoPE scaling, the base and, for ``dynamic``, the context up to which it equals default."""
        params = self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            self.problems.append(f"rope_parameters {shorten(params)} (a JSON object is needed)")
            return RopeScaling(), DEFAULT_ROPE_THETA, None
        if params and all(isinstance(v, dict) for v in params.values()):
            self.problems.append(f"RoPE parameters per layer type ({', '.join(params)})")
            return RopeScaling(), DEFAULT_ROPE_THETA, None
        theta = params.get("rope_theta", self.raw.get("rope_theta", DEFAULT_ROPE_THETA))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            self.problems.append(f"rope_theta {shorten(theta)} (a number > 0 is needed)")
            theta = DEFAULT_ROPE_THETA
        partial = params.get("partial_rotary_factor", self.raw.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            self.problems.append(f"partial_rotary_factor {shorten(partial)} (RoPE on part of each head)")
        if head_dim % 2:
            self.problems.append(f"head_dim {head_dim} (RoPE needs an even head dimension)")
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        theta = float(theta)
        try:
            if kind == "default":
                return RopeScaling(), theta, None
            if kind == "linear":
                return RopeScaling("linear", factor=params["factor"]), theta, None
            if kind == "llama3":
                original = params.get("original_max_position_embeddings") or self.raw.get(
                    "max_position_embeddings", 2048
                )
                scaling = RopeScaling(
                    "llama3",
                    factor=params["factor"],
                    low_freq_factor=params["low_freq_factor"],
                    high_freq_factor=params["high_freq_factor"],
                    original_max_position_embeddings=original,
                )
                return scaling, theta, None
            if kind == "dynamic":
                limit = self.raw.get("max_position_embeddings", 2048)
                self.notes.append(
                    f"dynamic RoPE equals default RoPE up to max_position_embeddings ({limit}), the "
                    "context limit here"
                )
                return RopeScaling(), theta, limit
        except KeyError as exc:
            self.problems.append(f"rope_type {kind!r} without {exc.args[0]!r}")
            return RopeScaling(), theta, None
        except ConfigError as exc:
            self.problems.append(f"rope_type {kind!r}: {exc}")
            return RopeScaling(), theta, None
        self.problems.append(
            f"rope_type {shorten(kind)} (served: default, linear, llama3, and dynamic within "
            "max_position_embeddings)"
        )
        return RopeScaling(), theta, None


def token_ids(value: Any) -> tuple[int, ...]:
    """An id or a list of ids (as configs spell EOS) as a tuple; anything else is no ids."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()
