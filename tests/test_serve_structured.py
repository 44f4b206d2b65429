"""Structured output and tool calling through ``devgraph serve`` and the ``openai`` client on its defaults:
``.parse()`` with pydantic response formats, ``pydantic_function_tool`` and the stream helpers, against
tiny checkpoints that carry the chat templates of Qwen2.5 (Hermes tool calls) and Llama 3.1 (JSON calls).

The weights are random, so the schemas bound their strings and numbers: every answer can finish within
the budget, and every answer that finishes must parse and validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from servers import ServerProcess

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance", reason="structured output needs llguidance (the structured extra)")

COMMON = [
    *("--device", "cpu", "--cpu-threads", "1", "--max-running-requests", "4", "--token-budget", "64"),
    *("--max-seq-len", "4096"),
]  # a Llama 3.1 prompt with two tools is ~2000 tiny-vocab tokens


class Weather(pydantic.BaseModel):
    """Bounded fields: a random model reaches the end of every one."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = pydantic.Field(ge=1, le=7)
    rain: bool


class GetTime(pydantic.BaseModel):
    zone: Literal["UTC", "CET"]


@pytest.fixture(scope="module")
def servers(tool_checkpoints: dict[str, Path]) -> Iterator[dict[str, ServerProcess]]:
    started: dict[str, ServerProcess] = {}
    try:
        started["qwen2.5"] = ServerProcess("--model", str(tool_checkpoints["qwen2.5"]), *COMMON)
        started["llama3.1"] = ServerProcess(
            "--model", str(tool_checkpoints["llama3.1"]), *COMMON, "--structured-outputs", "json"
        )
        yield started
    finally:
        codes = {name: server.stop() for name, server in started.items()}
        assert all(code == 0 for code in codes.values()), codes


def _client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _model(client: Any) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1"])
def test_parse_with_a_pydantic_model_gives_a_parsed_answer(
    servers: dict[str, ServerProcess], family: str
) -> None:
    client = _client(servers[family])
    model = _model(client)
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": "the weather, as JSON"}],
            response_format=Weather,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Weather)
        assert Weather.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_vllm_fields_on_both_routes(servers: dict[str, ServerProcess]) -> None:
    client = _client(servers["qwen2.5"])
    model = _model(client)
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=0,
        extra_body={"structured_outputs": None},
    )
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    regex = client.completions.create(
        model=model,
        prompt="code:",
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": "[A-F]{3}-[0-9]{2}"}},
    )
    assert regex.choices[0].finish_reason == "stop"
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    choice = client.completions.create(
        model=model, prompt="pick:", max_tokens=40, extra_body={"guided_choice": ["naïve", "café", "日本"]}
    )
    assert choice.choices[0].text in ("naïve", "café", "日本")
    stream = client.completions.create(
        model=model,
        prompt="x",
        max_tokens=60,
        stream=True,
        extra_body={
            "structured_outputs": {
                "json": Weather.model_json_schema(),  # pydantic's schema allows other properties
                "disable_any_whitespace": True,
                "disable_additional_properties": True,
            }
        },
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    text = "".join(chunk.text for chunk in chunks)
    assert chunks[-1].finish_reason == "stop", text
    assert set(json.loads(text)) == {"city", "days", "rain"}
    Weather.model_validate_json(text)
    assert " " not in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"structured_outputs": {"regex": "(("}}, "regex parse error"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"not": {}}, "strict": True},
                }
            },
            "Unimplemented keys",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not implemented"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "one output constraint"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "llguidance"),
        ({"guided_choice": []}, "choices must be"),
        ({"response_format": {"type": "grammar"}}, "response_format type"),
        ({"guided_json": {"type": "array", "items": json.loads("[" * 40 + "]" * 40)}}, "nests deeper"),
    ],
)
def test_refusals_are_400s_with_the_reason(
    servers: dict[str, ServerProcess], extra: dict[str, Any], message: str
) -> None:
    client = _client(servers["qwen2.5"])
    with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(")):
        client.chat.completions.create(
            model=_model(client), messages=[{"role": "user", "content": "hi"}], max_tokens=5, extra_body=extra
        )


def test_the_operator_limits_what_requests_constrain(servers: dict[str, ServerProcess]) -> None:
    client = _client(servers["llama3.1"])  # --structured-outputs json
    with pytest.raises(openai.BadRequestError, match="--structured-outputs json"):
        client.completions.create(
            model=_model(client), prompt="x", max_tokens=5, extra_body={"guided_regex": "a+"}
        )


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1"])
def test_required_and_named_tool_choice_call_tools_with_valid_arguments(
    servers: dict[str, ServerProcess], family: str
) -> None:
    client = _client(servers[family])
    model = _model(client)
    tools = [
        openai.pydantic_function_tool(Weather, name="get_weather"),
        openai.pydantic_function_tool(GetTime),
    ]
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    required = client.chat.completions.parse(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice="required",
        max_tokens=300,
        parallel_tool_calls=False,
        seed=1,
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "GetTime")
    assert isinstance(
        call.function.parsed_arguments, Weather if call.function.name == "get_weather" else GetTime
    )
    named = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "GetTime"}},
        max_tokens=300,
        seed=2,
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "GetTime" and call.id.startswith("call_")
    GetTime.model_validate_json(call.function.arguments)
    assert named.choices[0].message.content is None
    # The calls and a tool's answer go back as history, rendered by the model's own template.
    history = [
        *messages,
        named.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    follow = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=8)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1"])
def test_streamed_tool_calls_accumulate_in_the_sdk(servers: dict[str, ServerProcess], family: str) -> None:
    client = _client(servers[family])
    tools = [openai.pydantic_function_tool(Weather, name="get_weather")]
    with client.chat.completions.stream(
        model=_model(client),
        messages=[{"role": "user", "content": "weather?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=300,
        seed=3,  # sampled: with a seed the random model's number of calls is fixed
        stream_options={"include_usage": True},
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert all(isinstance(call.function.parsed_arguments, Weather) for call in choice.message.tool_calls)
    assert final.usage is not None and final.usage.completion_tokens > 0


def test_tools_need_a_template_that_renders_them(hf_cases: dict[str, Any]) -> None:
    """The checkpoints of tests/checkpoints.py carry a template without tools: refused, not ignored."""
    from devgraph.serve.api.chat import parse_chat
    from devgraph.serve.api.protocol import ApiError
    from devgraph.serve.checkpoint.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(hf_cases["qwen2"].directory)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [openai.pydantic_function_tool(GetTime)],
    }
    with pytest.raises(ApiError, match="does not render tools"):
        parse_chat(body, tokenizer, "m", context=256, defaults={}, eos_token_ids=())
    del body["tools"]
    generation, _ = parse_chat(body, tokenizer, "m", context=256, defaults={}, eos_token_ids=())
    assert generation.grammar is None
