"""transformers on the benchmark's checkpoint: the eager oracle and the compiled baseline.

* ``greedy``: ``generate()`` one prompt at a time (batch 1, no padding), greedy, every new token kept
  (the EOS id is cleared, as the servers get ``ignore_eos``), cuDNN SDPA off (with it HF eager is not
  reproducible run to run on an H100). Its tokens are the oracle.
* ``compiled``: ``generate(cache_implementation="static")``, which compiles its decode step on a GPU
  (inductor, CUDA graphs); per-token latency is the median interval between per-step CUDA events (a logits
  processor, prefill excluded; ``hf_measure.step_clock``), median over the timed calls; throughput is the
  batch's new tokens over a whole call's wall seconds (prefill included). The first call is the warm-up
  (its compile) and is reported apart. On the CPU (``--smoke``) the static cache runs uncompiled.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from hf_measure import step_clock, sync

__all__ = ["compiled", "greedy", "load", "release"]


def load(directory: Path, dtype: str, device: str) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # every new token counts, as with ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def release(model: Any) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """Each prompt's greedy continuation (batch 1), and the seconds it all took."""
    device = model.device
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    start = time.perf_counter()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            tokens = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
            outputs.append(tokens[0, len(prompt) :].tolist())
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    return outputs, time.perf_counter() - start


def compiled(
    model: Any, batch: int, prompt_len: int, new_tokens: int, repeats: int, compile_: bool
) -> dict[str, Any]:
    """HF's static-cache ``generate()`` at ``batch``: warm-up seconds, per-token ms, tokens/s."""
    device = model.device
    generator = torch.Generator(device=device).manual_seed(batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=device, generator=generator)
    extra = {} if compile_ else {"disable_compile": True}

    def call() -> tuple[float, list[float]]:
        clock = step_clock(device)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                cache_implementation="static",
                max_cache_len=prompt_len + new_tokens,
                logits_processor=[clock],
                **extra,
            )
        sync(device)
        return time.perf_counter() - start, clock.step_ms()

    first, _ = call()
    walls, medians = [], []
    for _ in range(repeats):
        wall, steps = call()
        walls.append(wall)
        medians.append(statistics.median(steps))
    best = min(walls)
    return {
        "batch": batch,
        "compiled": compile_,
        "warmup_s": round(first - best, 2),
        "per_token_ms": round(statistics.median(medians), 3),
        "generate_s": round(statistics.median(walls), 3),
        "output_tokens_per_s": round(batch * new_tokens / statistics.median(walls), 1),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }
