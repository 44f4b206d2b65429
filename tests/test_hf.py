"""devgraph.integrations.transformers on the CPU: tiny random Qwen3 / Llama (configs built here, no
downloads, float32), decode steps replayed from CPU-simulated graphs, checked against HF eager generate()."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from devgraph.errors import BackendUnavailableError, ConfigError
from devgraph.integrations.hf import lib

try:
    import transformers as tf
except ImportError:
    tf = None

needs_hf = pytest.mark.skipif(
    tf is None, reason="transformers is not installed (pip install 'devgraph[transformers]')"
)

PAD, BOS = 0, 1
MAX_CACHE_LEN = 48
SIZES = (1, 2, 4)  # the shared cache has 4 rows


def tiny_model(arch: str, **overrides: Any) -> Any:
    """A 2-layer random ``Qwen3ForCausalLM`` or ``LlamaForCausalLM``, float32, eval, sdpa attention."""
    common: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": None,
        **overrides,
    }
    torch.manual_seed(0)
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **common)).eval()
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()


def left_padded(lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths`` padded on the left: ``input_ids`` and ``attention_mask``."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, 256, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def hf_eager(model: Any, ids: torch.Tensor, **kwargs: Any) -> Any:
    """The reference: HF's own loop on a static cache of the same length, no compile."""
    return model.generate(
        ids, cache_implementation="static", max_cache_len=MAX_CACHE_LEN, disable_compile=True, **kwargs
    )


GREEDY = {"do_sample": False, "max_new_tokens": 10, "pad_token_id": PAD}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def decoder(request: pytest.FixtureRequest) -> Iterator[Any]:
    from devgraph.integrations.transformers import DevgraphDecoder

    model = tiny_model(request.param)
    with DevgraphDecoder(model, sizes=SIZES, max_cache_len=MAX_CACHE_LEN) as built:
        yield built


# -- packaging ------------------------------------------------------------------------------------------
def test_importing_the_integration_does_not_import_transformers() -> None:
    code = (
        "import sys, devgraph, devgraph.integrations.transformers as t; "
        "assert 'transformers' not in sys.modules, 'imported eagerly'; print(t.DevgraphDecoder.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DevgraphDecoder"


def test_missing_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def without_transformers(name: str, *args: Any) -> Any:
        if name == "transformers":
            raise ImportError("No module named 'transformers'")
        return real(name, *args)

    monkeypatch.setattr(lib, "_module", None)
    monkeypatch.setattr(lib.importlib, "import_module", without_transformers)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'devgraph\[transformers\]'"):
        lib.transformers()


# -- tokens identical to HF eager generate() -----------------------------------------------------------
@needs_hf
def test_greedy_tokens_match_hf_eager_batch_1_padded_batch_and_past_the_largest_size(decoder: Any) -> None:
    model = decoder.model
    before = decoder.stats()
    one = torch.tensor([[5, 17, 42, 9, 77, 3, 120]])
    assert torch.equal(decoder.generate(one, **GREEDY), hf_eager(model, one, **GREEDY))
    ids, mask = left_padded((4, 9, 6), seed=1)  # 3 rows replay the graph of size 4
    expected = hf_eager(model, ids, attention_mask=mask, **GREEDY)
    assert torch.equal(decoder.generate(ids, attention_mask=mask, **GREEDY), expected)
    # A generation config asking for a static cache: the decoder's own cache is used instead.
    config = tf.GenerationConfig(cache_implementation="static", **GREEDY)
    assert torch.equal(decoder.generate(one, generation_config=config), hf_eager(model, one, **GREEDY))
    ids, mask = left_padded((3, 8, 5, 8, 2), seed=2)  # 5 rows > max_batch 4: HF's own loop
    expected = hf_eager(model, ids, attention_mask=mask, **GREEDY)
    assert torch.equal(decoder.generate(ids, attention_mask=mask, **GREEDY), expected)

    after = decoder.stats()
    assert after["generate_calls"] - before["generate_calls"] == 4
    assert after["graph_generate_calls"] - before["graph_generate_calls"] == 3
    assert after["fallbacks"]["past_largest"] - before["fallbacks"]["past_largest"] == 1
    replays = after["runner"]["replays_by_key"]
    old = before["runner"]["replays_by_key"]
    steps = GREEDY["max_new_tokens"] - 1  # the first new token comes from the prefill
    assert replays["tokens=1"] - old.get("tokens=1", 0) == 2 * steps
    assert replays["tokens=4"] - old.get("tokens=4", 0) == steps
    assert after["runner"]["eager"] == 0


@needs_hf
def test_early_eos_and_return_dict_with_scores_match_hf_eager(decoder: Any) -> None:
    model = decoder.model
    ids, mask = left_padded((4, 9, 6), seed=1)
    width = ids.shape[1]
    eos = int(hf_eager(model, ids, attention_mask=mask, **GREEDY)[0, width + 3])  # row 0's 4th new token
    extra = {
        "eos_token_id": eos,
        "return_dict_in_generate": True,
        "output_scores": True,
        "output_logits": True,
    }
    expected = hf_eager(model, ids, attention_mask=mask, **GREEDY, **extra)
    got = decoder.generate(ids, attention_mask=mask, **GREEDY, **extra)

    assert type(got) is type(expected) is tf.generation.utils.GenerateDecoderOnlyOutput
    assert torch.equal(got.sequences, expected.sequences)
    assert bool((got.sequences[0, width + 4 :] == PAD).all()), "row 0 did not stop at its EOS"
    assert len(got.scores) == len(expected.scores) and len(got.logits) == len(expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits, strict=True))
    # The cache object comes back as the view of the shared cache that generate() was given.
    assert got.past_key_values is decoder.cache.view(3)


@needs_hf
def test_sampling_matches_hf_eager_with_the_same_seed(decoder: Any) -> None:
    ids, mask = left_padded((5, 7), seed=3)
    sample = {"do_sample": True, "top_k": 20, "temperature": 0.8, "max_new_tokens": 8, "pad_token_id": PAD}
    sample["num_return_sequences"] = 2  # 2 prompts x 2 samples: 4 rows, the largest captured size
    torch.manual_seed(7)
    expected = hf_eager(decoder.model, ids, attention_mask=mask, **sample)
    torch.manual_seed(7)
    got = decoder.generate(ids, attention_mask=mask, **sample)
    assert got.shape[0] == 4 and torch.equal(got, expected)


class RecordingStreamer:
    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ends += 1


@needs_hf
def test_streamer_sees_what_hf_eager_streams(decoder: Any) -> None:
    one = torch.tensor([[5, 17, 42, 9]])
    expected, got = RecordingStreamer(), RecordingStreamer()
    hf_eager(decoder.model, one, streamer=expected, **GREEDY)
    decoder.generate(one, streamer=got, **GREEDY)
    assert got.ends == expected.ends == 1
    assert len(got.puts) == len(expected.puts) == 1 + GREEDY["max_new_tokens"]  # the prompt, then each token
    assert all(torch.equal(a, b) for a, b in zip(got.puts, expected.puts, strict=True))


# -- state, fallbacks, refusals -------------------------------------------------------------------------
@needs_hf
def test_capture_and_verify_leave_the_write_positions_where_they_were() -> None:
    from devgraph.integrations.transformers import DevgraphDecoder

    with DevgraphDecoder(
        tiny_model("llama"), sizes=(1, 2), max_cache_len=MAX_CACHE_LEN, capture=False
    ) as dec:
        for position in dec.cache.write_positions:
            position.fill_(5)  # as if mid-sequence
        dec.capture()
        assert [int(p) for p in dec.cache.write_positions] == [5, 5]
        ids = torch.tensor([[3], [4]])
        result = dec.runner.verify(input_ids=ids, position_ids=torch.tensor([[5], [5]]))
        assert result.ok, result
        assert [int(p) for p in dec.cache.write_positions] == [5, 5]
        assert dec.runner.inspect()["state"]["tensors"], "the write positions are declared state"


@needs_hf
def test_calls_the_graphs_cannot_run_fall_back_and_are_counted(decoder: Any) -> None:
    model = decoder.model
    one = torch.tensor([[5, 17, 42, 9]])
    before = dict(decoder.stats()["fallbacks"])
    beams = {**GREEDY, "num_beams": 2}
    assert torch.equal(decoder.generate(one, **beams), model.generate(one, **beams))
    long_prompt = torch.arange(3, 3 + MAX_CACHE_LEN - 8)[None]  # + 10 new tokens > MAX_CACHE_LEN positions
    assert torch.equal(decoder.generate(long_prompt, **GREEDY), model.generate(long_prompt, **GREEDY))
    embeds = model.get_input_embeddings()(one)
    assert torch.equal(
        decoder.generate(inputs_embeds=embeds, **GREEDY), model.generate(inputs_embeds=embeds, **GREEDY)
    )
    after = decoder.stats()["fallbacks"]
    for reason in ("generation_mode", "longer_than_cache", "inputs_embeds"):
        assert after[reason] == before[reason] + 1, reason


@needs_hf
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"synced_gpus": True}, "synced_gpus"),
        ({"past_key_values": object()}, "past_key_values"),
        ({"cache_implementation": "static"}, "cache_implementation"),
        ({"custom_generate": lambda *a, **k: None}, "custom_generate"),
    ],
)
def test_generate_arguments_that_clash_with_the_decoder_are_refused(decoder: Any, kwargs: dict, match: str):
    with pytest.raises(ConfigError, match=match):
        decoder.generate(torch.tensor([[5, 6]]), **GREEDY, **kwargs)


def _model_with(change: str) -> Any:
    if change == "encoder-decoder":
        config = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
        return tf.T5ForConditionalGeneration(config).eval()
    if change == "sliding window":
        config = tf.MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
        )
        return tf.MistralForCausalLM(config).eval()
    if change == "linear attention":
        return tiny_model("qwen3", layer_types=["linear_attention", "full_attention"])
    model = tiny_model("llama")
    if change == "flex attention":
        model.config._attn_implementation = "flex_attention"
    elif change == "training":
        model.train()
    return model


@needs_hf
@pytest.mark.parametrize(
    "change, match",
    [
        ("encoder-decoder", "encoder-decoder"),
        ("sliding window", "StaticSlidingWindowLayer"),
        ("linear attention", "LinearAttentionLayer"),
        ("flex attention", "attn_implementation='sdpa'"),
        ("training", r"model\.eval\(\)"),
    ],
)
def test_unsupported_models_are_refused_with_what_to_do(change: str, match: str) -> None:
    from devgraph.integrations.transformers import DevgraphDecoder

    with pytest.raises(ConfigError, match=match):
        DevgraphDecoder(_model_with(change), max_batch=2, max_cache_len=16)


# -- modes and the fast path ------------------------------------------------------------------------------
@needs_hf
def test_disabled_mode_runs_the_same_step_eagerly() -> None:
    from devgraph.integrations.transformers import DevgraphDecoder

    model = tiny_model("qwen3")
    ids, mask = left_padded((4, 6), seed=4)
    with DevgraphDecoder(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, config="disabled") as dec:
        assert torch.equal(
            dec.generate(ids, attention_mask=mask, **GREEDY),
            hf_eager(model, ids, attention_mask=mask, **GREEDY),
        )
        assert dec.stats()["runner"]["eager_by_reason"]["disabled"] == GREEDY["max_new_tokens"] - 1


@needs_hf
def test_fast_path_windows_match_and_close_restores_the_model() -> None:
    from devgraph.integrations.transformers import DevgraphDecoder, FastPath

    model = tiny_model("qwen3")
    modeling = sys.modules[type(model).__module__]
    rope_before = modeling.apply_rotary_pos_emb
    attention = tf.modeling_utils.ALL_ATTENTION_FUNCTIONS
    local_before = dict(attention._local_mapping)
    ids, mask = left_padded((4, 9, 6), seed=1)
    kwargs = {**GREEDY, "max_new_tokens": 20, "return_dict_in_generate": True, "output_scores": True}
    expected = hf_eager(model, ids, attention_mask=mask, **kwargs)
    # The "eager" compiler traces the regions with dynamo and runs the traced ops (no C++ compile on CI).
    fast = FastPath(compiler="eager", windows=(16, 32))
    with DevgraphDecoder(model, sizes=SIZES, max_cache_len=MAX_CACHE_LEN, fast=fast) as dec:
        assert dec.windows == (16, 32, MAX_CACHE_LEN)
        got = dec.generate(ids, attention_mask=mask, **kwargs)
        described = dec.inspect()["fast"]
        replays = dec.stats()["runner"]["replays_by_key"]
    assert torch.equal(got.sequences, expected.sequences)
    worst = max(float((a - b).abs().max()) for a, b in zip(got.scores, expected.scores, strict=True))
    assert worst < 1e-4, worst  # compiled regions and packed GQA round differently, not more
    assert replays == {"tokens=4,window=16": 7, "tokens=4,window=32": 12}  # prompt 9 + 20 new = 29 positions
    assert described["skipped"] == [] and described["installed"] > 0
    assert described["frames_compiled"] <= 5  # one per function and input rank, for every batch size
    assert all("forward" not in vars(module) for module in model.modules())
    assert modeling.apply_rotary_pos_emb is rope_before
    assert dict(attention._local_mapping) == local_before


@needs_hf
def test_two_fast_decoders_share_the_patches_and_the_last_close_restores_the_model() -> None:
    from devgraph.integrations.transformers import DevgraphDecoder

    model = tiny_model("llama")
    modeling = sys.modules[type(model).__module__]
    rope_before = modeling.apply_rotary_pos_emb
    local_before = dict(tf.modeling_utils.ALL_ATTENTION_FUNCTIONS._local_mapping)
    first = DevgraphDecoder(model, max_batch=2, max_cache_len=16, fast=True, capture=False)
    second = DevgraphDecoder(model, max_batch=2, max_cache_len=16, fast=True, capture=False)
    first.close()  # closed first, while the second still decodes with the fast path
    assert modeling.apply_rotary_pos_emb is not rope_before
    assert "forward" in vars(model.model.norm)
    second.close()
    assert modeling.apply_rotary_pos_emb is rope_before
    assert all("forward" not in vars(module) for module in model.modules())
    assert dict(tf.modeling_utils.ALL_ATTENTION_FUNCTIONS._local_mapping) == local_before


@needs_hf
def test_bad_decoder_arguments_are_config_errors() -> None:
    from devgraph.integrations.transformers import DevgraphDecoder, FastPath

    model = tiny_model("llama")
    for kwargs, match in (
        ({"max_cache_len": 0}, "max_cache_len"),
        ({"max_cache_len": 16, "max_batch": 2, "sizes": (1, 4)}, "max_batch"),
        ({"max_cache_len": 16, "fast": "yes"}, "fast"),
        ({"max_cache_len": 16, "fast": FastPath(windows=(99,))}, "windows"),
        # No FastPath: the message is about the cache, not about windows.
        ({"max_cache_len": 2}, "max_cache_len 2 is too short for 2 warm-up steps"),
        (
            {"max_cache_len": 64, "fast": FastPath(windows=(16,)), "warmup_iters": 16},
            "FastPath window 16 is too short for 16 warm-up steps.*longer than 16",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            DevgraphDecoder(model, capture=False, **kwargs)
    with pytest.raises(ConfigError, match="compiler"):
        FastPath(compiler="tvm")
    for windows in ((3,), (1, 64), ()):
        with pytest.raises(ConfigError, match="FastPath windows must be"):
            FastPath(windows=windows)


@needs_hf
def test_a_flag_max_size_past_max_batch_is_capped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from devgraph.integrations.transformers import DevgraphDecoder

    flag = '{"decode": {"max_size": 64, "sizes": [1, 64]}}'
    with (
        caplog.at_level(logging.WARNING, logger="devgraph.integrations.transformers"),
        DevgraphDecoder(
            tiny_model("llama"), max_cache_len=16, max_batch=2, config=flag, capture=False
        ) as dec,
    ):
        assert dec.runner.sizes == (1, 2)
    assert any("capped at max_batch=2" in r.getMessage() for r in caplog.records)


# -- on a GPU ----------------------------------------------------------------------------------------------
@needs_hf
@pytest.mark.cuda
def test_cuda_graphs_give_hf_eager_tokens_and_the_fast_path_stays_close() -> None:
    from devgraph.integrations.transformers import DevgraphDecoder, FastPath

    model = tiny_model("qwen3").cuda()
    ids, mask = (t.cuda() for t in left_padded((4, 9, 6), seed=1))
    kwargs = {**GREEDY, "max_new_tokens": 16, "return_dict_in_generate": True, "output_scores": True}
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention is not reproducible run to run
    try:
        expected = hf_eager(model, ids, attention_mask=mask, **kwargs)
        with DevgraphDecoder(model, sizes=SIZES, max_cache_len=MAX_CACHE_LEN) as exact:
            got = exact.generate(ids, attention_mask=mask, **kwargs)
            assert exact.stats()["runner"]["replays_by_key"] == {"tokens=4": 15}
        assert torch.equal(got.sequences, expected.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
        with DevgraphDecoder(
            model, sizes=SIZES, max_cache_len=MAX_CACHE_LEN, fast=FastPath(windows=(16, 32))
        ) as fast:
            close = fast.generate(ids, attention_mask=mask, **kwargs)
            assert fast.inspect()["fast"]["skipped"] == []
        worst = max(float((a - b).abs().max()) for a, b in zip(close.scores, expected.scores, strict=True))
        assert worst < 1e-3, worst  # inductor's kernels round differently from HF's eager ones
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
