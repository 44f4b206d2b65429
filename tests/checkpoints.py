"""Tiny Hugging Face checkpoints built here, nothing downloaded: random weights saved with
``save_pretrained`` from transformers' own config classes, and a byte-level BPE tokenizer trained with the
``tokenizers`` library on a few sentences, saved with a chat template.

One checkpoint per family the server runs, each exercising that family's features: Llama with llama3 RoPE
scaling and untied embeddings, Qwen2 with q/k/v biases and tied embeddings, Qwen3 with per-head q/k
norms, Mistral with linear RoPE scaling and no sliding window. Every weight is random, norm scales and
biases included (transformers would start them at one and zero, which a loader that skipped them would
not notice).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a graph captured once replays every step of the decoder",
    "hello world, how are you today? fine, thanks!",
    "tokens flow from the prompt through every layer to the logits",
    "naïve café façade: ünïcödé text with accents, 日本語 and emoji 🙂",
    "def main(): return 42  # some code, too",
]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INST = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
    "{{ message['content'] }} [/INST]{% elif message['role'] == 'system' %}<<SYS>>{{ message['content'] }}"
    "<</SYS>>{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

# Small shapes: two layers, GQA (4 query heads, 2 KV heads), head_dim 16; the vocabulary is the tokenizer's.
SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "mistral": dict(
        tie_word_embeddings=False,
        sliding_window=None,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
}
#: Weight seeds: each family's prompt set stays at least 1e-4 away from a greedy tie (see hf_greedy).
SEEDS = {"llama": 0, "qwen2": 2, "qwen3": 0, "mistral": 0}
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build_tokenizer(style: str) -> Any:
    """A byte-level BPE tokenizer trained on :data:`CORPUS`: ``chatml`` (Qwen's special tokens and
    template) or ``inst`` (Llama/Mistral's ``<s>``/``</s>``, BOS added to every encoding, [INST] template)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if style == "chatml" else ["<unk>", "<s>", "</s>"]
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    if style == "chatml":
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=CHATML,
        )
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=INST
    )


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer with text for every id below ``vocab_size``: ``<unk>``, ``<s>``, ``</s>``
    and then ``w3``, ``w4``, ... (decoded with a space between words). A random model samples any id of its
    vocabulary; under the BPE tokenizer above most of them (past its 400 tokens) have no text, so a stream
    holds them back (a stream never sends a chunk without text) and a client measures no inter-token time.
    Real checkpoints' tokenizers cover their vocabulary; this one does too, with a plain vocabulary lookup
    (no added-token matching, which would make detokenization unlike a real tokenizer's)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=INST
    )


def build_checkpoint(
    directory: Path, family: str, *, seed: int | None = None, std: float = 0.15, **overrides: Any
) -> Path:
    """Save a random-weight ``family`` checkpoint (float32) with its tokenizer under ``directory``;
    ``overrides``: config fields (shape, ``vocab_size``) over :data:`SHAPE` and the family's."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in _CLASSES[family])
    tokenizer = build_tokenizer("chatml" if family.startswith("qwen") else "inst")
    eos = tokenizer.eos_token_id
    settings = {"vocab_size": len(tokenizer), **SHAPE, **FAMILIES[family], **overrides}
    # A larger vocab_size than the tokenizer's (as real checkpoints pad theirs) is allowed: ids past it
    # are never produced by the tokenizer, only by the model.
    config = config_class(eos_token_id=eos, bos_token_id=tokenizer.bos_token_id, **settings)
    torch.manual_seed(SEEDS[family] if seed is None else seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))
    model.generation_config.eos_token_id = eos
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


PROMPTS = [
    "the quick brown fox",
    "hello world",
    "日本語 🙂",
    "def main(): return",
    # Longer than the servers' 32-token step budget: a chunked prefill.
    " ".join(CORPUS[:4]),
    "tokens flow from the prompt",
]
NEW_TOKENS = 20


@dataclass(frozen=True)
class Greedy:
    """transformers' greedy continuation of one prompt: the new tokens up to (not including) an EOS, the
    raw log-softmax of each chosen token, and the smallest gap between the two largest logits on the way
    (how far every step is from a tie that float rounding could flip)."""

    tokens: list[int]
    logprobs: list[float]
    margin: float


def hf_greedy(directory: Path, prompts: list[list[int]], max_new_tokens: int = NEW_TOKENS) -> list[Greedy]:
    """transformers' own greedy ``generate()`` (float32, CPU, one prompt at a time)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            result = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = result.sequences[0, len(prompt) :].tolist()
            logits = torch.cat(result.logits).float()
            end = next((i for i, t in enumerate(tokens) if t in stop), len(tokens))
            top2 = logits[:end].topk(2, dim=-1).values if end else torch.zeros(1, 2)
            logp = logits.log_softmax(-1)[torch.arange(end), torch.tensor(tokens[:end], dtype=torch.long)]
            outputs.append(Greedy(tokens[:end], logp.tolist(), float((top2[:, 0] - top2[:, 1]).min())))
    return outputs


#: Llama-3-8B's shape (8.03 B parameters: 16.06 GB in bf16), for the tensor-parallel serving benchmark.
LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
_SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_random_checkpoint(
    directory: Path,
    family: str = "llama",
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    shard_bytes: int = 4 << 30,
    seed: int = 0,
    words: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """A checkpoint of any size, written fast: no model is built (the tensor names and shapes come from
    transformers' model class on the meta device), each tensor is drawn on ``device`` (a GPU draws 16 GB
    in well under a second) and streamed to its shard as it is drawn, so at most one tensor is in host
    memory. Matrices ~ N(0, 1/fan_in), norm scales 1 + N(0, 0.2^2), biases N(0, 0.5^2); safetensors
    shards of about ``shard_bytes`` with an index, the family's tokenizer. ``overrides``: config fields
    over :data:`SHAPE` and the family's (pass :data:`LLAMA3_8B` for the 8B shape). Returns what was
    written and how long it took. ``words``: :func:`word_tokenizer` (text for every id of the vocabulary;
    the serving benchmarks' choice, so that every sampled token streams) instead of the family's."""
    import json
    import struct
    import time

    import transformers

    start = time.perf_counter()
    config_class, model_class = (getattr(transformers, name) for name in _CLASSES[family])
    if words:
        tokenizer = word_tokenizer(int(overrides.get("vocab_size", SHAPE.get("vocab_size", 400))))
    else:
        tokenizer = build_tokenizer("chatml" if family.startswith("qwen") else "inst")
    settings = {"vocab_size": len(tokenizer), **SHAPE, **FAMILIES[family], **overrides}
    config = config_class(
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        dtype=str(dtype).removeprefix("torch."),
        **settings,
    )
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in model_class(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    element = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = element * _count(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for index, names in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            nbytes = element * _count(shapes[name])
            header[name] = {
                "dtype": _SAFETENSORS_NAMES[dtype],
                "shape": list(shapes[name]),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(directory / file, "wb") as handle:
            handle.write(struct.pack("<Q", len(text)) + text)
            for name in names:
                tensor = _draw(name, shapes[name], dtype, device, generator).cpu()
                handle.write(_host_bytes(tensor))
        total += offset
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the drawing's cached blocks would hold GPU memory the servers need
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))
    return {
        "directory": str(directory),
        "bytes": total,
        "shards": len(shards),
        "tensors": len(shapes),
        "seconds": round(time.perf_counter() - start, 2),
        "drawn_on": device,
        "weights": "matrices ~ N(0, 1/fan_in), norm scales 1 + N(0, 0.04), biases N(0, 0.25)",
    }


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _draw(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str, generator: torch.Generator
) -> torch.Tensor:
    draw = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        draw.mul_(0.2).add_(1.0)
    elif name.endswith("bias"):
        draw.mul_(0.5)
    else:
        draw.mul_(shape[-1] ** -0.5)
    return draw.to(dtype)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (and without numpy); valid while ``tensor`` lives."""
    import ctypes

    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    raw = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    return memoryview(raw).cast("B")
