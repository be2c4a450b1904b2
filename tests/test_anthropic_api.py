"""The Anthropic Messages API through the official `anthropic` SDK (x-api-key auth)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers import TOOLS_KEY, Server

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
NO_THINKING: Any = {"type": "disabled"}


@pytest.fixture(scope="module")
def client(tools_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=tools_server.url, api_key=TOOLS_KEY, max_retries=0, timeout=120
    )


def test_message_non_streaming(client: anthropic.Anthropic) -> None:
    r = client.messages.create(
        model="tools",
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"temperature": 0},  # the 2.x SDK has no sampling arguments
        thinking=NO_THINKING,
    )
    assert r.type == "message" and r.role == "assistant" and r.model == "tools"
    assert r.id.startswith("msg_")
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in r.content] in (["text"], [])
    assert 1 <= r.usage.output_tokens <= 12
    counted = client.messages.count_tokens(
        model="tools",
        system="You are terse.",
        messages=[{"role": "user", "content": "Hello"}],
        thinking=NO_THINKING,
    )
    assert counted.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)


def test_message_streaming_matches_and_follows_the_event_sequence(
    client: anthropic.Anthropic,
) -> None:
    kw: dict[str, Any] = {
        "model": "tools",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "extra_body": {"temperature": 0},
        "thinking": {"type": "enabled", "budget_tokens": 4},
    }
    full = client.messages.create(**kw)
    events = []
    with client.messages.stream(**kw) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[-2] == "message_delta"
    assert events.count("content_block_start") == events.count("content_block_stop")
    assert [b.type for b in final.content] == [b.type for b in full.content]
    assert final.content[0].type == "thinking"  # the budget closed the reasoning block
    assert final.model_dump()["content"] == full.model_dump()["content"]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="tools",
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0.8, "top_k": 50},
        thinking=NO_THINKING,
    )
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # the round trip: the tool_use block back, then its tool_result
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "rain, 8 C"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    follow = client.messages.create(
        model="tools",
        max_tokens=6,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=conversation,  # type: ignore[arg-type]
        thinking=NO_THINKING,
    )
    assert follow.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(
        model="tools",
        tools=[WEATHER],  # type: ignore[list-item]
        messages=conversation,  # type: ignore[arg-type]
        thinking=NO_THINKING,
    )
    total = follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == total > first.usage.input_tokens


def test_tool_use_streaming(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="tools",
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking=NO_THINKING,
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])


def test_structured_output(client: anthropic.Anthropic) -> None:
    schema = WEATHER["input_schema"]
    r = client.messages.create(
        model="tools",
        max_tokens=80,
        messages=[{"role": "user", "content": "json"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        thinking=NO_THINKING,
    )
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)  # type: ignore[union-attr]


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {
        "model": "tools",
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "stop test"}],
        "extra_body": {"temperature": 0},
        "thinking": NO_THINKING,
    }
    text = client.messages.create(**kw).content[0].text  # type: ignore[union-attr]
    if len(text) < 6:
        pytest.skip("the random model produced too little text")
    stop = text[3:6]
    r = client.messages.create(**kw, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_errors_are_anthropic_shaped(tools_server: Server, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    url = f"{tools_server.url}/v1/messages"
    ok = {"model": "tools", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        ({"model": "tools", "messages": ok["messages"]}, {"x-api-key": TOOLS_KEY}, 400),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, None, 400),
        ({**ok, "tools": [{"name": "w", "type": "web_search_20250305"}]}, None, 400),
        (ok, {"x-api-key": "sk-wrong-0123456789"}, 401),
        (ok, {}, 401),
    ]
    for body, headers, status in cases:
        h = {"x-api-key": TOOLS_KEY} if headers is None else headers
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == status, (body, r.text)
        # Anthropic's shape, also for refusals before the route (401 from auth)
        err = r.json()
        kind = {400: "invalid_request_error", 401: "authentication_error"}[status]
        assert err["type"] == "error" and err["error"]["type"] == kind, err
        assert err["error"]["message"]
    # a body over max_body_bytes, refused by aiohttp before any handler runs
    big = httpx.post(
        url,
        content=b'{"x": "' + b"a" * (9 << 20) + b'"}',
        headers={"x-api-key": TOOLS_KEY, "content-type": "application/json"},
        timeout=30,
    )
    assert big.status_code == 413
    assert big.json()["error"]["type"] == "request_too_large"
    # The raw stream: event names and JSON bodies.
    with httpx.stream(
        "POST", url, json={**ok, "stream": True}, headers={"x-api-key": TOOLS_KEY}, timeout=30
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert [d["type"] for d in datas] == names
