"""Tool calling and reasoning separation.

Random-weight models never choose to call a tool or close a reasoning block, so:
- the parser paths run on crafted token sequences from the tiny tools model's
  tokenizer, through the same streaming detokenizer and splitter as a request
  (token by token, in one piece, and split at every point);
- the server paths run end to end with the constrained decoder forcing the tool
  call (tool_choice `required` / a named function) and the thinking budget
  forcing the end of the reasoning block.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from gateway.serving.reasoning import NORMAL, REASONING, OutputFormat, OutputSplitter, Split
from gateway.serving.tokenizer import Frontend
from tests.helpers import TOOLS_KEY, Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NO_THINKING = {"enable_thinking": False}


# -- the parser paths on crafted token sequences ------------------------------------


@pytest.fixture(scope="module")
def frontend(tiny_tools_model_dir: Path) -> Iterator[Frontend]:
    f = Frontend(str(tiny_tools_model_dir), [2])
    yield f
    f.close()


def fmt_for(frontend: Frontend, initial: str = NORMAL, tools: bool = True) -> OutputFormat:
    assert frontend.think_start and frontend.think_end
    assert frontend.tool_start and frontend.tool_end
    return OutputFormat(
        think=(frontend.think_start, frontend.think_end),
        tool=(frontend.tool_start, frontend.tool_end) if tools else None,
        parser=frontend.tool_parser if tools else None,
        tools=[WEATHER, TIME] if tools else None,
        initial=initial,
    )


def run_tokens(frontend: Frontend, fmt: OutputFormat, ids: list[int], cuts: list[int]) -> Split:
    """Feed ids in pieces (cut before each index in cuts), as engine steps would."""
    stream, splitter = frontend.text_stream([]), OutputSplitter(fmt)
    total = Split()
    bounds = [0, *cuts, len(ids)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        final = i == len(bounds) - 2
        part = splitter.feed(stream.add(ids[a:b], final=final).text, final=final)
        total.content += part.content
        total.reasoning += part.reasoning
        total.tool_calls += part.tool_calls
    return total


def every_split(frontend: Frontend, fmt: OutputFormat, text: str) -> list[Split]:
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    runs = [
        run_tokens(frontend, fmt, ids, []),
        run_tokens(frontend, fmt, ids, list(range(1, len(ids)))),
    ]
    runs += [run_tokens(frontend, fmt, ids, [k]) for k in range(1, len(ids))]
    return runs


def test_markers_are_single_tokens_and_parser_inferred(frontend: Frontend) -> None:
    assert frontend.tool_parser_name == "json_tools"
    assert frontend.has_thinking and frontend.has_tool_calling and frontend.thinking_switch
    for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert len(frontend.marker_ids(marker)) == 1, marker


def test_reasoning_then_content_at_every_split(frontend: Frontend) -> None:
    text = "<think>\nLet me see: 2 + 2.\n</think>\n\nThe answer is 4."
    for run in every_split(frontend, fmt_for(frontend), text):
        assert run.reasoning == "\nLet me see: 2 + 2.\n"
        assert run.content == "\n\nThe answer is 4."
        assert run.tool_calls == []


def test_prompt_opened_reasoning_block(frontend: Frontend) -> None:
    fmt = fmt_for(frontend, initial=REASONING)
    for run in every_split(frontend, fmt, "thinking hard</think>Paris."):
        assert (run.reasoning, run.content) == ("thinking hard", "Paris.")


def test_closing_marker_split_across_tokens(tiny_model_dir: Path) -> None:
    """A model whose markers are ordinary text: `</think>` spans several BPE tokens."""
    f = Frontend(str(tiny_model_dir), [2])
    try:
        ids = f.tokenizer.encode("</think>", add_special_tokens=False)
        assert len(ids) > 1  # the marker really is split across tokens
        fmt = OutputFormat(think=("<think>", "</think>"), initial=REASONING)
        for run in every_split(f, fmt, "So it is Paris.</think>The capital is Paris."):
            assert run.reasoning == "So it is Paris."
            assert run.content == "The capital is Paris."
        # Text that only looks like the start of a marker is not lost.
        for run in every_split(f, fmt, "a </thin b</think>c </"):
            assert (run.reasoning, run.content) == ("a </thin b", "c </")
    finally:
        f.close()


def test_tool_calls_are_parsed_with_ids(frontend: Frontend) -> None:
    text = (
        "Let me check.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    for run in every_split(frontend, fmt_for(frontend), text):
        assert run.content.strip() == "Let me check."
        assert [c["function"]["name"] for c in run.tool_calls] == ["get_weather", "get_time"]
        assert [c["index"] for c in run.tool_calls] == [0, 1]
        args = json.loads(run.tool_calls[0]["function"]["arguments"])
        assert args == {"city": "Paris", "unit": "celsius", "days": 2}
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in run.tool_calls)


def test_reasoning_then_tool_call(frontend: Frontend) -> None:
    text = (
        '<think>need weather</think><tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>"
    )
    for run in every_split(frontend, fmt_for(frontend), text):
        assert run.reasoning == "need weather" and run.content == ""
        assert run.tool_calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_unparseable_or_unterminated_tool_calls(frontend: Frontend) -> None:
    for run in every_split(frontend, fmt_for(frontend), "A<tool_call>\n{not json}\n</tool_call>B"):
        assert run.tool_calls == [] and run.content == "A<tool_call>\n{not json}\n</tool_call>B"
    # Cut off by max_tokens after the JSON but before the end marker: still a call.
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
    for run in every_split(frontend, fmt_for(frontend), text):
        assert [c["function"]["name"] for c in run.tool_calls] == ["get_time"]


def test_without_tools_markers_stay_content(frontend: Frontend) -> None:
    text = '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    for run in every_split(frontend, fmt_for(frontend, tools=False), text):
        assert run.tool_calls == [] and run.content == text


# -- end to end with the openai SDK ----------------------------------------------------


@pytest.fixture(scope="module")
def client(tools_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.v1, api_key=TOOLS_KEY, max_retries=0, timeout=120)


def check_call(call: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    spec = next(t for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, spec["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return args


def test_forced_tool_call_non_streaming(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="tools",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body=NO_THINKING,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert 1 <= len(calls) <= 8
        for call in calls:
            check_call(call, [WEATHER, TIME])
        assert len({c.id for c in calls}) == len(calls)


def test_forced_tool_call_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        temperature=0.7,
        seed=1,
        stream=True,
        extra_body=NO_THINKING,
    )
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = tc.id or acc["id"]
            acc["name"] += (tc.function and tc.function.name) or ""
            acc["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content == ""
    assert [c["name"] for c in calls.values()] == ["get_time"]  # named: exactly one call
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME["function"]["parameters"])


def test_no_parallel_calls_when_disabled(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model="tools",
            messages=[{"role": "user", "content": "weather and time?"}],
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body=NO_THINKING,
        )
        assert len(r.choices[0].message.tool_calls or []) == 1


def test_tool_result_round_trip(
    client: openai.OpenAI, tools_server: Server, frontend: Frontend
) -> None:
    first = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        extra_body=NO_THINKING,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Rome?"},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    r = httpx.post(
        f"{tools_server.v1}/chat/completions",
        headers={"Authorization": f"Bearer {TOOLS_KEY}"},
        json={
            "model": "tools",
            "messages": messages,
            "tools": [WEATHER],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
            "enable_thinking": False,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    tok = frontend.tokenizer.decode(body["prompt_token_ids"])
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in tok
    assert '"name": "get_weather", "arguments": {' in tok


def test_tool_choice_none_never_calls(tools_server: Server) -> None:
    start_id = 506  # <tool_call> in the tiny tools vocabulary
    for seed in range(4):
        r = httpx.post(
            f"{tools_server.v1}/chat/completions",
            headers={"Authorization": f"Bearer {TOOLS_KEY}"},
            json={
                "model": "tools",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [WEATHER],
                "tool_choice": "none",
                "max_tokens": 24,
                "temperature": 1.5,
                "seed": seed,
                "return_token_ids": True,
                "enable_thinking": False,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert start_id not in choice["token_ids"]
        assert "tool_calls" not in choice["message"]


def test_model_without_tool_support_is_a_400(server: Server) -> None:
    c = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not support tool calling"):
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER],
            max_tokens=4,
        )
    for extra in ({"enable_thinking": True}, {"thinking_budget": 8}):
        with pytest.raises(openai.BadRequestError, match="does not support thinking"):
            c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body=extra,
            )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required", "tools": []}, "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "share a name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "array", "uniqueItems": True},
                        },
                    }
                ],
            },
            "not supported for constrained decoding",
        ),
    ],
)
def test_bad_tool_requests(client: openai.OpenAI, extra: dict[str, Any], message: str) -> None:
    body = {"tools": [WEATHER], **extra}
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            model="tools",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body=body,
        )


# -- reasoning end to end ----------------------------------------------------------


def test_reasoning_budget_separates_reasoning(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Think about it"}]
    full = client.chat.completions.create(
        model="tools",
        messages=msgs,
        max_tokens=24,
        temperature=0,
        extra_body={"thinking_budget": 6},
    )
    message = full.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert reasoning  # the template opened the block; the budget closed it
    content = message.content or ""
    for marker in ("<think>", "</think>"):
        assert marker not in content and marker not in reasoning
    stream = client.chat.completions.create(
        model="tools",
        messages=msgs,
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body={"thinking_budget": 6},
    )
    order, s_reasoning, s_content = [], "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        r = getattr(delta, "reasoning_content", None) or ""
        if r:
            order.append("r")
            s_reasoning += r
        if delta.content:
            order.append("c")
            s_content += delta.content
    assert (s_reasoning, s_content) == (reasoning, content)
    assert order == sorted(order, reverse=True)  # all reasoning before any content


def test_thinking_switch(client: openai.OpenAI, tools_server: Server) -> None:
    r = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    # Thinking on (the model's default) and no budget: the random model never
    # closes the block, so everything it writes is reasoning.
    r = client.chat.completions.create(
        model="tools", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert getattr(r.choices[0].message, "reasoning_content", None)
    assert r.choices[0].message.content == ""


def test_reasoning_then_structured_answer(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "2+2?"}],
        max_tokens=64,
        temperature=0.8,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"thinking_budget": 5},
    )
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None)
    jsonschema.validate(json.loads(message.content or ""), schema)
    assert r.choices[0].finish_reason == "stop"
