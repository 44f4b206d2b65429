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


@pytest.mark.parametrize(
    "version, warns", [("5.16.1", True), ("5.17.0", False), ("5.24.3", False), ("6.0.0", True)]
)
def test_a_transformers_outside_the_tested_range_is_used_with_one_warning(
    version: str, warns: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # No refusal by version string: the pieces are checked by feature when a decoder is built.
    fake = type(sys)("transformers")
    fake.__version__ = version  # type: ignore[attr-defined]
    real = importlib.import_module
    monkeypatch.setattr(lib, "_module", None)
    monkeypatch.setattr(
        lib.importlib, "import_module", lambda name, *a: fake if name == "transformers" else real(name, *a)
    )
    with caplog.at_level(logging.WARNING, logger="devgraph.integrations.transformers"):
        assert lib.transformers() is fake and lib.transformers() is fake
    said = [r.getMessage() for r in caplog.records if "outside the range" in r.getMessage()]
    assert len(said) == int(warns), said  # once, however often the module is asked for
    assert all(f"transformers {version} is outside" in m and lib.SUPPORTED in m for m in said), said


# -- tokens identical to HF eager generate() -----------------------------------------------------------
@needs_hf
def test_greedy_tokens_match_hf_eager_batch_1_and_past_the_largest_size(decoder: Any) -> None:
    model = decoder.model
    before = decoder.stats()
    one = torch.tensor([[5, 17, 42, 9, 77, 3, 120]])
    expected = hf_eager(model, one, **GREEDY)
    assert torch.equal(decoder.generate(one, **GREEDY), expected)
    # A generation config asking for a static cache: the decoder's own cache is used instead.
    config = tf.GenerationConfig(cache_implementation="static", **GREEDY)
    assert torch.equal(decoder.generate(one, generation_config=config), expected)
    ids, mask = left_padded((3, 8, 5, 8, 2), seed=2)  # 5 rows > max_batch 4: HF's own loop
    expected = hf_eager(model, ids, attention_mask=mask, **GREEDY)
    assert torch.equal(decoder.generate(ids, attention_mask=mask, **GREEDY), expected)

    after = decoder.stats()
    assert after["generate_calls"] - before["generate_calls"] == 3
    assert after["graph_generate_calls"] - before["graph_generate_calls"] == 2
    assert after["fallbacks"]["past_largest"] - before["fallbacks"]["past_largest"] == 1
    steps = GREEDY["max_new_tokens"] - 1  # the first new token comes from the prefill
    assert replayed_since(before, decoder) == {"tokens=1": 2 * steps}
    assert after["runner"]["eager"] == 0


def replayed_since(before: dict[str, Any], decoder: Any) -> dict[str, int]:
    """Graph replays per key since ``before`` (a ``decoder.stats()``), keys that replayed only."""
    old = before["runner"]["replays_by_key"]
    now = decoder.stats()["runner"]["replays_by_key"]
    return {key: n - old.get(key, 0) for key, n in now.items() if n != old.get(key, 0)}


# Exactness, as docs/huggingface.md states it. A replay at the batch's own size runs HF's kernels at HF's
# shapes: bitwise. A batch padded up to a captured size runs its matmuls with more rows, and MKL / oneDNN may
# block M=3 and M=4 differently (AVX2 and SSE4.2 sgemm kernels do; AVX-512 ones may not), summing each dot
# product in another order. Those scores are held to torch.testing's float32 tolerance below: the tolerance
# torch itself uses for the same float32 math run by different kernels, ~40x the largest difference seen
# (2.4e-7 on logits of magnitude < 0.7, with MKL_ENABLE_INSTRUCTIONS=AVX2 or SSE4_2).
FLOAT32_ROUNDING = {"rtol": 1.3e-6, "atol": 1e-5}
SCORED = {**GREEDY, "return_dict_in_generate": True, "output_scores": True, "output_logits": True}


def cache_of(output: Any) -> Any:
    """The cache a ``GenerateDecoderOnlyOutput`` carries (``cache`` since transformers 5.24)."""
    return output.cache if "cache" in type(output).__dataclass_fields__ else output.past_key_values


@needs_hf
@pytest.mark.filterwarnings("error::FutureWarning")  # a deprecated transformers keyword would warn
def test_a_batch_that_fills_a_captured_size_gives_hf_eager_scores_and_logits_bitwise(decoder: Any) -> None:
    model = decoder.model
    ids, mask = left_padded((4, 9, 6, 7), seed=1)  # 4 rows: the graph of size 4, no padding row
    width = ids.shape[1]
    eos = int(hf_eager(model, ids, attention_mask=mask, **GREEDY)[0, width + 3])  # row 0's 4th new token
    expected = hf_eager(model, ids, attention_mask=mask, **SCORED, eos_token_id=eos)
    before = decoder.stats()
    got = decoder.generate(ids, attention_mask=mask, **SCORED, eos_token_id=eos)

    assert replayed_since(before, decoder) == {"tokens=4": len(expected.scores) - 1}  # prefill: 1st token
    assert type(got) is type(expected) is tf.generation.utils.GenerateDecoderOnlyOutput
    assert torch.equal(got.sequences, expected.sequences)
    assert bool((got.sequences[0, width + 4 :] == PAD).all()), "row 0 did not stop at its EOS"
    assert len(got.scores) == len(expected.scores) and len(got.logits) == len(expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits, strict=True))
    # The cache comes back (under this transformers' field name) as the view generate() was given.
    assert cache_of(got) is decoder.cache.view(4)


@needs_hf
def test_a_padded_batch_gives_hf_eager_tokens_and_scores_within_float32_rounding(decoder: Any) -> None:
    model = decoder.model
    ids, mask = left_padded((4, 9, 6), seed=1)  # 3 rows replay the graph of size 4
    expected = hf_eager(model, ids, attention_mask=mask, **SCORED)
    before = decoder.stats()
    got = decoder.generate(ids, attention_mask=mask, **SCORED)

    assert replayed_since(before, decoder) == {"tokens=4": GREEDY["max_new_tokens"] - 1}
    worst = 0.0
    for name in ("scores", "logits"):
        for a, b in zip(getattr(got, name), getattr(expected, name), strict=True):
            torch.testing.assert_close(a, b, **FLOAT32_ROUNDING)
            worst = max(worst, float((a - b).abs().max()))
    # Greedy tokens are equal wherever no step's two best scores lie within the rounding of each other.
    margin = min(float((s.topk(2).values[:, 0] - s.topk(2).values[:, 1]).min()) for s in expected.scores)
    assert margin > 2 * worst, (margin, worst)
    assert torch.equal(got.sequences, expected.sequences)
    # At the padded shape the graph is HF's eager step exactly: same kernels, same shapes.
    step = decoder.runner.verify(input_ids=ids[:, -1:], position_ids=torch.tensor([[4], [9], [6]]))
    assert step.size == 4 and step.max_abs_diff == 0.0, step
    assert step.max_abs_diff_unpadded <= FLOAT32_ROUNDING["atol"], step


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
        ({"cache": object()}, "takes no cache="),  # the keyword since transformers 5.24
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


def _forward_without_a_cache_keyword(
    self: Any, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, **kwargs: Any
) -> Any:
    return tf.LlamaForCausalLM.forward(
        self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    )


@needs_hf
@pytest.mark.parametrize("missing", ["forward's cache keyword", "cumulative_length", "custom_generate"])
def test_a_missing_transformers_piece_is_refused_naming_the_version_the_piece_and_the_range(
    missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devgraph.integrations.transformers import DevgraphDecoder

    model = tiny_model("llama")
    if missing == "forward's cache keyword":  # a release that renames it again, or a model's own forward
        model.__class__ = type(
            "NoCacheKeyword", (type(model),), {"forward": _forward_without_a_cache_keyword}
        )
        piece = "NoCacheKeyword.forward takes neither `cache` nor `past_key_values`"
    elif missing == "cumulative_length":  # a release that renames the static layers' write position
        init = tf.cache_utils.StaticLayer.__init__

        def renamed(layer: Any, *args: Any, **kwargs: Any) -> None:
            init(layer, *args, **kwargs)
            layer.write_position = vars(layer).pop("cumulative_length")

        monkeypatch.setattr(tf.cache_utils.StaticLayer, "__init__", renamed)
        piece = "cache layer 0 (StaticLayer) has no 0-d tensor `cumulative_length`"
    else:  # a generate() that no longer takes a decode loop
        generate = model.generate
        monkeypatch.setattr(model, "generate", lambda inputs=None, **kwargs: generate(inputs, **kwargs))
        piece = "generate() takes no `custom_generate`"
    with pytest.raises(ConfigError) as refused:
        DevgraphDecoder(model, max_batch=2, max_cache_len=16)
    message = str(refused.value)
    assert f"under transformers {tf.__version__}: " in message, message
    assert piece in message, message
    assert "devgraph supports transformers 5.17 to 5.24" in message, message
    assert "pip install 'transformers>=5.17,<5.25'" in message, message


# -- modes and the fast path ------------------------------------------------------------------------------
@needs_hf
def test_disabled_mode_runs_the_same_step_eagerly() -> None:
    from devgraph.integrations.transformers import DevgraphDecoder

    model = tiny_model("qwen3")
    ids, mask = left_padded((4, 6, 5), seed=4)  # 3 rows: no padding without graphs, so HF's own shapes
    with DevgraphDecoder(model, max_batch=4, max_cache_len=MAX_CACHE_LEN, config="disabled") as dec:
        got = dec.generate(ids, attention_mask=mask, **SCORED)
        assert dec.stats()["runner"]["eager_by_reason"]["disabled"] == GREEDY["max_new_tokens"] - 1
    expected = hf_eager(model, ids, attention_mask=mask, **SCORED)
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))


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
    kwargs = {**GREEDY, "max_new_tokens": 16, "return_dict_in_generate": True, "output_scores": True}
    full = [t.cuda() for t in left_padded((4, 9, 6, 7), seed=1)]  # fills the graph of size 4
    padded = [t.cuda() for t in left_padded((4, 9, 6), seed=1)]  # replays it with one padding row
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention is not reproducible run to run
    try:
        expected = [hf_eager(model, ids, attention_mask=mask, **kwargs) for ids, mask in (full, padded)]
        with DevgraphDecoder(model, sizes=SIZES, max_cache_len=MAX_CACHE_LEN) as exact:
            got = [exact.generate(ids, attention_mask=mask, **kwargs) for ids, mask in (full, padded)]
            assert exact.stats()["runner"]["replays_by_key"] == {"tokens=4": 30}
        assert all(torch.equal(a.sequences, b.sequences) for a, b in zip(got, expected, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got[0].scores, expected[0].scores, strict=True))
        for a, b in zip(got[1].scores, expected[1].scores, strict=True):
            torch.testing.assert_close(a, b, **FLOAT32_ROUNDING)  # cuBLAS may pick another kernel for M=4
        with DevgraphDecoder(
            model, sizes=SIZES, max_cache_len=MAX_CACHE_LEN, fast=FastPath(windows=(16, 32))
        ) as fast:
            close = fast.generate(padded[0], attention_mask=padded[1], **kwargs)
            assert fast.inspect()["fast"]["skipped"] == []
        scores = zip(close.scores, expected[1].scores, strict=True)
        worst = max(float((a - b).abs().max()) for a, b in scores)
        assert worst < 1e-3, worst  # inductor's kernels round differently from HF's eager ones
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
