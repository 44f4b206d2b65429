"""What structured output costs per decode step: the engine's inter-token latency with every request
constrained to a JSON schema, against the same engine unconstrained, at concurrency 1 and 32.

``--gpu`` (the recorded run, about 2 minutes on one H100): Qwen3-0.6B's shape, bf16, decode graphs
(``--device-graph-mode auto``), 32 running requests. The tokenizer is a byte-level BPE vocabulary of
Qwen2.5's size (151,643 tokens, the model's 151,936 ids), made here from the words of Python's standard
library (no download): the masks are computed over a real-sized token trie, which is what their cost
depends on. For each concurrency the same prompts run twice, unconstrained and constrained; every decode
step is timed (``Engine.step`` ends with the sampled tokens on the host, so it covers the device), and the
host time of each mask computation is recorded apart. The graphs must keep replaying (no eager decode
step), and every constrained output that finishes must parse and follow the schema (checked in the run).

The masks are computed while the device runs the step's forward (the sampler calls the masker before
anything reads the logits), so the overhead is the mask's upload and apply on the device plus whatever
host time the forward does not cover.

Writes ``$OUT/structured.json`` and ``$OUT/structured.png`` (``benchmarks/results/`` when ``OUT`` is unset).
``--smoke`` runs the same on the CPU with the tiny preset (a 500-token vocabulary) in about half a minute.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from devgraph.reference.config import ReferenceConfig
from devgraph.reference.model import ReferenceModel
from devgraph.serve.engine import Engine, EngineConfig, FinishReason, SamplingParams
from devgraph.serve.structured import GrammarCompiler, GrammarSpec, Whitespace

ROOT = Path(__file__).resolve().parent.parent
#: A schema whose outputs run long (lists of strings), so most requests decode to max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 50},
        "rating": {"enum": ["good", "bad", "fine"]},
    },
    "required": ["title", "year", "tags", "rating"],
    "additionalProperties": False,
}
GPU: dict[str, Any] = {
    "preset": "qwen3-0.6b",
    "device": "cuda",
    "dtype": torch.bfloat16,
    "vocab": 151_643,
    "running": 32,
    "budget": 2048,
    "concurrency": (1, 32),
    "prompt": 32,
    "max_tokens": 128,
}
SMOKE: dict[str, Any] = {
    "preset": "tiny",
    "device": "cpu",
    "dtype": torch.float32,
    "vocab": 500,
    "running": 8,
    "budget": 64,
    "concurrency": (1, 8),
    "prompt": 8,
    "max_tokens": 24,
}


def build_tokenizer(size: int) -> Any:
    """A byte-level BPE tokenizer of ``size`` tokens: the 256 bytes, then the most frequent words and
    punctuation runs (with their leading space, as GPT-2-style vocabularies hold them) of the standard
    library's source. Its merges are left out: only its vocabulary (the token trie) matters to the masks."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = {b: c for b, c in zip(range(256), sorted(alphabet, key=lambda c: _byte_of(c)), strict=True)}
    counts: collections.Counter[str] = collections.Counter()
    pieces = re.compile(r" ?[A-Za-z_]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9_]+|\s+")
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        counts.update(pieces.findall(path.read_text(encoding="utf-8", errors="ignore")))
        if 2 * len(counts) > size:  # each word gives a few tokens (below)
            break
    vocab = {byte_char[b]: b for b in range(256)}
    for word, _ in counts.most_common():
        if len(vocab) >= size - 1:
            break
        bare = word.strip()
        # As real vocabularies: the word with and without its leading space, lower-case and capitalised.
        for variant in dict.fromkeys((word, bare, f" {bare}", bare.capitalize(), f" {bare.capitalize()}")):
            if variant and len(vocab) < size - 1:
                vocab.setdefault("".join(byte_char[b] for b in variant.encode()), len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|endoftext|>")


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


class _TimedMasker:
    """Wraps the compiled grammars' masker to record the host time of each mask computation."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, []

    def mask(self, logits: torch.Tensor, rows: Any, states: Any) -> torch.Tensor:
        began = time.perf_counter()
        result = self.inner.mask(logits, rows, states)
        self.seconds.append(time.perf_counter() - began)
        return result


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[float], list[Any]]:
    """Every request at once; the wall time of each decode step with all of them running."""
    requests = [engine.add_request(p, params) for p in prompts]
    steps = []
    while engine.has_work:
        decodes = engine.step_counts["decode"]
        running = engine.num_running
        began = time.perf_counter()
        engine.step()
        took = time.perf_counter() - began
        if engine.step_counts["decode"] > decodes and running == len(prompts):
            steps.append(took)
    return steps, requests


def follows(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == set(SCHEMA["properties"])
        and isinstance(value["title"], str)
        and len(value["title"]) <= 40
        and type(value["year"]) is int
        and 1900 <= value["year"] <= 2100
        and all(isinstance(t, str) and len(t) <= 12 for t in value["tags"])
        and value["rating"] in ("good", "bad", "fine")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--gpu", action="store_true", help="the recorded run (one CUDA GPU)")
    group.add_argument("--smoke", action="store_true", help="the same on the CPU, tiny preset")
    args = parser.parse_args()
    settings = GPU if args.gpu else SMOKE
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(settings["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)

    began = time.perf_counter()
    hf_tokenizer = build_tokenizer(settings["vocab"])
    tokenizer_seconds = time.perf_counter() - began
    from devgraph.serve.checkpoint.hf_tokenizer import HFTokenizer

    with tempfile.TemporaryDirectory() as directory:  # the server's way in: a tokenizer directory
        hf_tokenizer.save_pretrained(directory)
        tokenizer = HFTokenizer(Path(directory))
    config = ReferenceConfig.preset(settings["preset"], dtype=settings["dtype"])
    model = ReferenceModel(config, device=device, seed=0)
    engine_config = EngineConfig(max_running_requests=settings["running"], token_budget=settings["budget"])
    engine = Engine(model, engine_config, device_graph_mode="auto")

    compiler = GrammarCompiler(tokenizer, config.vocab_size, tokenizer.eos_token_ids)
    began = time.perf_counter()
    grammar = compiler.compile_now(
        GrammarSpec.json_schema(SCHEMA, strict=True, whitespace=Whitespace(compact=True))
    )
    compile_seconds = time.perf_counter() - began
    timed = _TimedMasker(grammar.start().masker)
    grammar._masker = timed  # every state started from here on records its mask time

    generator = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {}
    engine.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4))  # first-use costs off the clock
    for concurrency in settings["concurrency"]:
        prompts = [
            torch.randint(0, hf_tokenizer.vocab_size - 1, (settings["prompt"],), generator=generator).tolist()
            for _ in range(concurrency)
        ]
        plain = SamplingParams(max_tokens=settings["max_tokens"], temperature=1.0, seed=1, stop_token_ids=())
        constrained = SamplingParams(
            max_tokens=settings["max_tokens"],
            temperature=1.0,
            seed=1,
            grammar=grammar,
            stop_token_ids=grammar.end_ids,
        )
        eager_before = engine.decode_runner.stats()["eager"]
        plain_steps, _ = run(engine, prompts, plain)
        timed.seconds.clear()
        structured_steps, requests = run(engine, prompts, constrained)
        eager = engine.decode_runner.stats()["eager"] - eager_before
        finished = [r for r in requests if r.finish_reason is FinishReason.STOP]
        parsed = [json.loads(tokenizer.decode(r.output)) for r in finished]
        assert all(follows(v) for v in parsed), "a finished output does not follow the schema"
        base, with_masks = statistics.median(plain_steps), statistics.median(structured_steps)
        results[f"c{concurrency}"] = {
            "concurrency": concurrency,
            "itl_ms_plain_median": base * 1e3,
            "itl_ms_structured_median": with_masks * 1e3,
            "overhead_fraction": with_masks / base - 1,
            "mask_host_ms_median": statistics.median(timed.seconds) * 1e3 if timed.seconds else None,
            "decode_steps_timed": {"plain": len(plain_steps), "structured": len(structured_steps)},
            "eager_decode_steps": eager,
            "constrained_finished": len(finished),
            "constrained_outputs_valid": len(parsed),
            "constrained_requests": len(requests),
        }
        assert eager == 0, f"{eager} decode steps ran eagerly"
        mask_ms = results[f"c{concurrency}"]["mask_host_ms_median"] or 0.0
        print(
            f"c={concurrency}: ITL plain {base * 1e3:.3f} ms, structured {with_masks * 1e3:.3f} ms "
            f"({(with_masks / base - 1) * 100:+.1f}%), mask host {mask_ms:.3f} ms; "
            f"{len(finished)}/{len(requests)} finished, all valid",
            flush=True,
        )
    report = {
        "benchmark": "bench_structured",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "llguidance": __import__("llguidance").__version__,
        "preset": settings["preset"],
        "dtype": str(settings["dtype"]),
        "tokenizer_vocab": len(hf_tokenizer),
        "model_vocab": config.vocab_size,
        "tokenizer_build_seconds": tokenizer_seconds,
        "schema_compile_seconds": compile_seconds,
        "device_graph_mode": "auto",
        "max_tokens": settings["max_tokens"],
        "results": results,
    }
    name = "structured" if args.gpu else "cpu-structured-smoke"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, out / f"{name}.png", report["device"])
    print(f"wrote {out / f'{name}.json'}")
    return 0


def _plot(results: dict[str, Any], path: Path, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results)
    plain = [results[n]["itl_ms_plain_median"] for n in names]
    structured = [results[n]["itl_ms_structured_median"] for n in names]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    positions = range(len(names))
    axis.bar([p - 0.2 for p in positions], plain, 0.4, label="unconstrained")
    axis.bar([p + 0.2 for p in positions], structured, 0.4, label="JSON schema")
    axis.set_xticks(list(positions), names)
    axis.set_ylabel("median ITL (ms)")
    axis.set_title(f"structured output per decode step ({device})")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
