"""``devgraph serve --model DIR`` as a subprocess on tiny local checkpoints of each family (CPU, one torch
thread): its greedy tokens equal transformers' ``generate()`` alone and under concurrent load, in a
different ``--device-graph-mode`` per family; the chat template; the ``openai`` client's completions and
chat calls, streaming included; stop strings, logprobs and echo; every field devgraph does not implement
answered with a 400 naming it; vLLM's metric names; the start-up report and the periodic stats line."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from servers import ServerProcess, stream_events

aiohttp = pytest.importorskip("aiohttp", reason="devgraph serve needs aiohttp")
pytestmark = pytest.mark.timeout(240)

COMMON = ["--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "4", "--token-budget", "32"]
#: One server per family, each in another mode: every mode meets real traffic on some checkpoint.
MODES = {
    "qwen3": ["--device-graph-mode", "auto", "--deterministic", "--log-stats-interval", "1"],
    "llama": ["--device-graph-mode", "disabled"],
    "qwen2": ["--device-graph-mode", "decode=full,prefill=breakable"],
    "mistral": ["--device-graph-mode", "auto"],
}


@pytest.fixture(scope="module")
def servers(hf_cases: dict[str, Any]) -> Iterator[dict[str, ServerProcess]]:
    started: dict[str, ServerProcess] = {}
    try:
        for family, flags in MODES.items():
            started[family] = ServerProcess("--model", str(hf_cases[family].directory), *COMMON, *flags)
        yield started
    finally:
        codes = {family: server.stop() for family, server in started.items()}
        assert all(code == 0 for code in codes.values()), codes


async def _completion(url: str, payload: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    """One streamed request: its token ids, text, finish reason and usage (if sent)."""
    result: dict[str, Any] = {"token_ids": [], "text": "", "finish_reason": None, "usage": None}
    for event in await stream_events(url, payload, path):
        result["usage"] = event.get("usage") or result["usage"]
        for choice in event["choices"]:
            part = choice.get("delta", choice)
            result["token_ids"] += part.get("token_ids", [])
            result["text"] += part.get("text", part.get("content")) or ""
            result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
    return result


# -- the oracle over HTTP -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(MODES))
def test_served_tokens_equal_transformers_alone_and_under_load(
    servers: dict[str, ServerProcess], hf_cases: dict[str, Any], family: str
) -> None:
    server, case = servers[family], hf_cases[family]
    expected = [g.tokens for g in case.expected]

    def payload(prompt: list[int]) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": 20, "temperature": 0}

    alone = [asyncio.run(_completion(server.url, payload(p)))["token_ids"] for p in case.prompts]

    async def together() -> list[dict[str, Any]]:
        return await asyncio.gather(*(_completion(server.url, payload(p)) for p in case.prompts * 2))

    loaded = asyncio.run(together())
    assert alone == expected
    assert [r["token_ids"] for r in loaded] == expected * 2
    reasons = {r["finish_reason"] for r in loaded}
    assert reasons <= {"length", "stop"}
    stats = server.wait_idle()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if family != "llama":  # llama's server runs with graphs disabled
        assert stats["runners"]["decode"]["replays"] > 0


def test_chat_renders_the_checkpoints_template(
    servers: dict[str, ServerProcess], hf_cases: dict[str, Any]
) -> None:
    import transformers
    from checkpoints import hf_greedy

    case = hf_cases["qwen3"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(case.directory)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    prompt = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    expected = hf_greedy(case.directory, [list(prompt)], 12)[0].tokens
    status, body = servers["qwen3"].post(
        {"messages": messages, "max_tokens": 12, "temperature": 0}, "/v1/chat/completions"
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert choice["token_ids"] == expected and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_the_openai_client_completes_and_chats_streaming_or_not(
    servers: dict[str, ServerProcess], hf_cases: dict[str, Any]
) -> None:
    openai = pytest.importorskip("openai")
    import transformers

    case, server = hf_cases["qwen3"], servers["qwen3"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(case.directory)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    name = str(case.directory)
    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(name).id == name
    text = "the quick brown fox"
    first = case.expected[0].tokens
    completion = client.completions.create(model=name, prompt=text, max_tokens=20, temperature=0)
    assert completion.choices[0].text == tokenizer.decode(first, skip_special_tokens=True)
    assert completion.usage.completion_tokens == len(first)
    pieces = client.completions.create(model=name, prompt=text, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == completion.choices[0].text
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model=name,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chat.usage.total_tokens
    with pytest.raises(openai.BadRequestError, match="presence_penalty 0.5 is not implemented"):
        client.chat.completions.create(model=name, messages=messages, presence_penalty=0.5)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-4")


def test_stop_strings_logprobs_and_echo(servers: dict[str, ServerProcess], hf_cases: dict[str, Any]) -> None:
    case, server = hf_cases["qwen3"], servers["qwen3"]
    full = asyncio.run(
        _completion(server.url, {"prompt": case.prompts[2], "max_tokens": 20, "temperature": 0})
    )
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2 and stop in text
    cut = text[: text.index(stop)]
    body = {"prompt": case.prompts[2], "max_tokens": 20, "temperature": 0, "stop": [stop, "never seen"]}
    streamed = asyncio.run(_completion(server.url, body))
    status, whole = server.post(body)
    assert streamed["text"] == whole["choices"][0]["text"] == cut, (text, stop)
    assert streamed["finish_reason"] == whole["choices"][0]["finish_reason"] == "stop"
    _, kept = server.post({**body, "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == cut + stop
    # Logprobs: the raw log-softmax of each greedy token (transformers' own logits), and the runners-up.
    _, scored = server.post({"prompt": case.prompts[0], "max_tokens": 20, "temperature": 0, "logprobs": 2})
    logprobs = scored["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx(case.expected[0].logprobs, abs=1e-4)
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]) and len(logprobs["tokens"]) == len(
        case.expected[0].tokens
    )
    _, chat = server.post(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
        "/v1/chat/completions",
    )
    entries = chat["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(chat["choices"][0]["token_ids"]) and all(
        len(e["top_logprobs"]) == 2 for e in entries
    )
    _, echoed = server.post({"prompt": "hello world", "max_tokens": 3, "temperature": 0, "echo": True})
    assert echoed["choices"][0]["text"].startswith("hello world")


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("payload", "param", "needle"),
    [
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
        ({**CHAT, "response_format": {"type": "grammar"}}, "response_format", "response_format type"),
        ({**CHAT, "n": 0}, "n", "n must be an integer from 1 to 64"),
        ({**CHAT, "max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
        ({**CHAT, "frequency_penalty": 0.3}, "frequency_penalty", "frequency_penalty 0.3 is not implemented"),
        ({**CHAT, "logit_bias": {"3": 5}}, "logit_bias", "logit_bias"),
        ({**CHAT, "echo": True}, "echo", "echo True is not implemented"),
        ({**CHAT, "repetition_penalty": 1.2}, "repetition_penalty", "repetition_penalty 1.2"),
        ({**CHAT, "min_p": 0.1}, "min_p", "min_p 0.1"),
        ({**CHAT, "mystery": 1}, "mystery", "does not take the field 'mystery'"),
        ({"max_tokens": 2}, "messages", "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role must be one of"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
            "only text parts are served",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
                ]
            },
            "messages",
            "tool_calls[0] needs function.name and function.arguments",
        ),
        ({**CHAT, "model": "gpt-4"}, "model", "not served here"),
        ({**CHAT, "max_tokens": 10_000}, None, "the model's context is 256"),
        (
            {**CHAT, "stream_options": {"continuous_usage_stats": "yes"}, "stream": True},
            "stream_options",
            "continuous_usage_stats must be true or false",
        ),
    ],
)
def test_every_unimplemented_chat_field_is_a_400_naming_it(
    servers: dict[str, ServerProcess], payload: dict[str, Any], param: str | None, needle: str
) -> None:
    status, body = servers["qwen3"].post(payload, "/v1/chat/completions")
    assert status == (404 if param == "model" else 400), body
    assert needle in body["error"]["message"] and body["error"]["param"] == param


def test_metrics_carry_vllms_names_and_types(
    servers: dict[str, ServerProcess], hf_cases: dict[str, Any]
) -> None:
    pytest.importorskip("prometheus_client")
    server = servers["qwen3"]
    server.post({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    status, text = server.request("GET", "/metrics")
    assert status == 200
    # prometheus_client names a counter's TYPE line with or without _total, by version.
    types = {
        name.removesuffix("_total"): kind
        for name, kind in (line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    }
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "devgraph_replays": "counter",
        "devgraph_eager_steps": "counter",
    }
    assert {name: types.get(name) for name in expected} == expected
    model = str(hf_cases["qwen3"].directory)
    assert f'vllm:generation_tokens_total{{engine="0",model_name="{model}"}}' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length"' in text


def test_start_up_is_reported_and_throughput_is_logged(servers: dict[str, ServerProcess]) -> None:
    server = servers["qwen3"]
    startup = server.stats()["startup"]
    assert {"model_read_s", "weights_s", "graphs_s", "warm_up_s", "ready_s"} <= set(startup)
    assert startup["weights"].startswith("loaded 24 tensors")
    server.post({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
    deadline = time.monotonic() + 10
    while (
        not any("Avg generation throughput" in line for line in server.stderr) and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    log = "".join(server.stderr)
    assert "devgraph.serve.stats INFO Avg prompt throughput:" in log and "KV cache usage:" in log, log[-2000:]
    assert "devgraph.serve.checkpoint.source INFO checkpoint" in log and "Qwen3ForCausalLM" in log
