"""The Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}).

End to end against a real server (tiny random tools model: thinking and tool-call
markers, two API keys) with the official `openai` SDK and the `openai-agents`
package; every response body, stream event and error is validated against the
schemas of OpenAI's official OpenAPI description (tests/data/openai-openapi.yaml.gz).

Random weights never emit EOS, so every request caps `max_output_tokens`, and
the paths that must end on their own (tool calls, structured output) are
forced by the constrained decoder. Thinking is on by default for this model and
it never closes the block by itself: requests either turn it off
(`reasoning.effort: "none"`) or bound it (`thinking_budget`).

The spec's schemas are loaded and checked by tests/spec.py (shared with
tests/test_conformance.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import FunctionToolParam, ResponseInputItemParam
from openai.types.shared_params import Reasoning
from pydantic import BaseModel, Field

from gateway.api.openai.responses_schemas import CreateResponseRequest
from gateway.api.openai.responses_store import ResponseStore
from gateway.api.openai.responses_translate import to_chat
from tests.helpers import Server, start_server, stop_server
from tests.spec import assert_valid

KEY_A = "sk-resp-a-0123456789"
KEY_B = "sk-resp-b-0123456789"
OFF: Reasoning = {"effort": "none"}  # thinking off (the chat template's enable_thinking=false)
WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


# -- the official spec's schemas -------------------------------------------------------


class Spec:
    """Validation against OpenAI's OpenAPI description's components (tests/spec.py)."""

    def validate(self, name: str, instance: Any) -> None:
        assert_valid(instance, name)


# The spec's schema for each event type mlxd sends.
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "error": "ResponseErrorEvent",
}


@pytest.fixture(scope="module")
def spec() -> Spec:
    return Spec()


# -- the server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(tiny_tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("logs") / "responses-server.log"
    server = start_server(
        str(tiny_tools_model_dir),
        log_path,
        model_name="tools",
        extra_args=["--api-key", KEY_A, "--api-key", KEY_B],
        env={"MLXD_TEST_FAULTS": "1"},  # the crash test
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key=KEY_A, max_retries=0, timeout=120)


def post(srv: Server, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    return httpx.post(
        srv.v1 + "/responses",
        json={"model": "tools", **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def events_of(srv: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events, checking that each `event:` names its data's type."""
    r = post(srv, {**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events, name = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert event["type"] == name
            events.append(event)
    return events


def stored(srv: Server, response_id: str) -> dict[str, Any]:
    """A stored response as the server sends it (GET /v1/responses/{id})."""
    r = httpx.get(f"{srv.v1}/responses/{response_id}", headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def output_texts(output: list[dict[str, Any]]) -> dict[str, str]:
    """Each output item's text by item type (reasoning, message)."""
    return {
        item["type"]: "".join(part["text"] for part in item["content"])
        for item in output
        if item["type"] in ("reasoning", "message")
    }


# -- without a server ------------------------------------------------------------------


def test_items_become_the_equivalent_chat_messages() -> None:
    body = CreateResponseRequest.model_validate(
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "rules"},
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": "two"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
            ],
            "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "g"}],
            },
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "none"},
            "max_output_tokens": 20,
            "seed": 7,
        }
    )
    chat = to_chat(body, [])
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [
        ("system", "be brief"),
        ("system", "rules"),
        ("user", "weather?"),
        ("assistant", ""),
        ("tool", "one"),
        ("tool", "two"),
        ("assistant", "done"),
    ]
    turn = chat["messages"][3]
    assert turn["reasoning_content"] == "think"
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert [t["function"]["name"] for t in chat["tools"]] == ["g"]  # allowed_tools
    assert chat["tool_choice"] == "required"
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["enable_thinking"] is False
    assert (chat["max_tokens"], chat["seed"]) == (20, 7)


def test_store_budget_ttl_and_owners() -> None:
    now = [0.0]
    store = ResponseStore(max_bytes=300, ttl_s=10, clock=lambda: now[0])
    one = {"id": "x" * 40}  # 49 bytes of JSON; with an empty context ("[]"), 51

    def context(entry_bytes: int) -> list[dict[str, str]]:
        return [{"t": "z" * (entry_bytes - 49 - len('[{"t":""}]'))}]

    assert store.put("r1", "a", one, []) and store.put("r2", None, one, [])
    assert store.put("r3", "a", one, [])
    assert store.nbytes == 3 * 51
    # An entry is its creator's; without keys (None) it is everyone's who has none.
    assert store.get("r1", "a") is not None and store.get("r1", "b") is None
    assert store.get("r1", None) is None and store.get("r2", None) is not None
    assert store.get("r2", "a") is None
    assert not store.delete("r1", "b") and store.get("r1", "a") is not None
    # Over the budget: the oldest goes first, and only as many as needed.
    assert store.put("r4", "a", one, context(150))
    assert store.nbytes == 2 * 51 + 150 and store.evicted == 1
    assert store.get("r1", "a") is None and store.get("r3", "a") is not None
    stored = store.get("r4", "a")
    assert stored is not None and stored.items() == context(150)
    assert not store.put("r5", "a", one, context(301))  # can never fit
    assert store.get("r5", "a") is None and store.nbytes == 2 * 51 + 150
    # Expiry: ttl_s after creation.
    now[0] = 5.0
    assert store.put("r6", "a", one, [])  # evicts r2, the oldest
    assert store.evicted == 2 and store.get("r2", None) is None
    now[0] = 9.9
    assert len(store) == 3
    now[0] = 10.0
    assert store.get("r3", "a") is None and store.get("r6", "a") is not None
    now[0] = 15.0
    assert store.get("r6", "a") is None and len(store) == 0 and store.nbytes == 0


# -- end to end: text, streaming, reasoning --------------------------------------------


def test_text_response_is_the_chat_answer(srv: Server, spec: Spec) -> None:
    """A string or a list of items: the same prompt and greedy answer as the chat route."""
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        {"type": "message", "role": "user", "content": "And of Italy?"},
    ]
    r = post(
        srv,
        {
            "input": items,
            "instructions": "You are terse.",
            "max_output_tokens": 16,
            "temperature": 0,
            "reasoning": OFF,
            "store": False,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    spec.validate("Response", body)
    chat = httpx.post(
        srv.v1 + "/chat/completions",
        headers={"Authorization": f"Bearer {KEY_A}"},
        json={
            "model": "tools",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"},
            ],
            "max_tokens": 16,
            "temperature": 0,
            "enable_thinking": False,
        },
        timeout=120,
    ).json()
    assert output_texts(body["output"]) == {"message": chat["choices"][0]["message"]["content"]}
    usage = body["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == 16 == chat["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + 16
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0
    # The cap cut it: incomplete, as OpenAI reports it.
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert body["id"].startswith("resp_") and body["store"] is False
    assert (body["instructions"], body["max_output_tokens"]) == ("You are terse.", 16)


def test_sdk_text_and_stream_agree(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {
        "model": "tools",
        "input": "Tell me a story",
        "max_output_tokens": 20,
        "temperature": 0,
        "reasoning": OFF,
    }
    whole = client.responses.create(**args)
    assert whole.status == "incomplete" and whole.output_text
    text, kinds, final = "", [], None
    for event in client.responses.create(**args, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.incomplete":
            final = event.response
    assert text == whole.output_text
    assert final is not None and final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 20
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    # A streamed response is stored as its final event shows it.
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def check_stream(events: list[dict[str, Any]], spec: Spec) -> dict[str, Any]:
    """The spec's schemas and ordering rules for one stream; returns the final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        spec.validate(EVENT_SCHEMAS[e["type"]], e)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    final = events[-1]["response"]
    assert events[-1]["type"] == f"response.{final['status']}"
    # Items open and close in order; every delta belongs to the open item, and the
    # deltas add up to the done events' text and to the final response's items.
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == list(range(len(final["output"])))
    assert [e["item"] for e in done] == final["output"]
    for index, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        kinds = [e["type"] for e in mine]
        assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
        if item["type"] == "function_call":
            deltas = [e["delta"] for e in mine if e["type"].endswith("arguments.delta")]
            assert "".join(deltas) == item["arguments"]
        else:
            deltas = [e["delta"] for e in mine if e["type"].endswith("_text.delta")]
            (text_done,) = [e for e in mine if e["type"].endswith("_text.done")]
            assert "".join(deltas) == text_done["text"] == item["content"][0]["text"]
        start = events.index(mine[0])
        assert events[start : start + len(mine)] == mine  # no interleaving
    return final


def test_reasoning_then_text_streamed(srv: Server, spec: Spec) -> None:
    budget = 6
    body = {
        "input": "Think first",
        "max_output_tokens": 24,
        "temperature": 0,
        "thinking_budget": budget,
        "store": False,
    }
    final = check_stream(events_of(srv, body), spec)
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    texts = output_texts(final["output"])
    assert texts["reasoning"] and texts["message"]
    for marker in ("<think>", "</think>"):
        assert marker not in texts["reasoning"] and marker not in texts["message"]
    # The budget's tokens inside the block, then its end marker.
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == budget + 1
    r = post(srv, body)
    assert r.status_code == 200, r.text
    spec.validate("Response", r.json())
    assert output_texts(r.json()["output"]) == texts  # greedy: streamed = whole
    assert r.json()["usage"]["output_tokens_details"] == final["usage"]["output_tokens_details"]


# -- tools ------------------------------------------------------------------------------


def test_function_call_round_trip(client: openai.OpenAI, srv: Server, spec: Spec) -> None:
    first = client.responses.create(
        model="tools",
        input="What is the weather in Rome?",
        instructions="Use the tools.",  # not carried over to the continuation
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=100,
        temperature=0,
        reasoning=OFF,
    )
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) >= 1 and first.output_text == ""
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    spec.validate("Response", stored(srv, first.id))
    # Continue from the stored response: only the tool's output is sent.
    results: list[ResponseInputItemParam] = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 24 C"}
        for c in calls
    ]
    second = client.responses.create(
        model="tools",
        previous_response_id=first.id,
        input=results,
        max_output_tokens=16,
        temperature=0,
        reasoning=OFF,
    )
    assert second.previous_response_id == first.id and second.output_text
    # The same conversation sent whole (no instructions), stored nowhere: the same
    # prompt and answer.
    whole = post(
        srv,
        {
            "input": [
                {"role": "user", "content": "What is the weather in Rome?"},
                *[o.model_dump(mode="json", exclude_none=True) for o in first.output],
                *results,
            ],
            "max_output_tokens": 16,
            "temperature": 0,
            "reasoning": OFF,
            "store": False,
        },
    ).json()
    assert second.usage is not None
    assert whole["usage"]["input_tokens"] == second.usage.input_tokens
    assert output_texts(whole["output"])["message"] == second.output_text


def test_function_call_streamed(srv: Server, spec: Spec) -> None:
    events = events_of(
        srv,
        {
            "input": "Weather in Oslo?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 100,
            "temperature": 0.8,
            "seed": 2,
            "reasoning": OFF,
        },
    )
    final = check_stream(events, spec)
    assert final["status"] == "completed"
    (item,) = final["output"]  # a named function: exactly one call, no text
    assert item["type"] == "function_call" and item["status"] == "completed"
    jsonschema.validate(json.loads(item["arguments"]), WEATHER["parameters"])
    kinds = [e["type"] for e in events[2:-1]]
    assert kinds == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]


def test_sdk_stream_helper_accumulates(client: openai.OpenAI) -> None:
    """The SDK's `responses.stream()` rebuilds reasoning and a call from the events."""
    with client.responses.stream(
        model="tools",
        input="Weather in Lima?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=160,
        temperature=0,
        extra_body={"thinking_budget": 5},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content
    assert reasoning.content[0].text == "".join(deltas)
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 6


def test_allowed_tools_restrict_the_choice(client: openai.OpenAI) -> None:
    clock: FunctionToolParam = {
        "type": "function",
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
        "strict": True,
    }
    for seed in range(3):
        r = client.responses.create(
            model="tools",
            input="What time is it?",
            tools=[WEATHER, clock],
            tool_choice={
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_time"}],
            },
            max_output_tokens=100,
            temperature=1.0,
            reasoning=OFF,
            extra_body={"seed": seed},
        )
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and {c.name for c in calls} == {"get_time"}


# -- structured output ----------------------------------------------------------------


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    celsius: int = Field(ge=-40, le=50)


def test_structured_output_parses(client: openai.OpenAI, srv: Server, spec: Spec) -> None:
    for seed in range(3):
        r = client.responses.parse(
            model="tools",
            input="Forecast for Paris, as JSON",
            text_format=Forecast,
            max_output_tokens=64,
            temperature=1.0,
            reasoning=OFF,
            extra_body={"seed": seed},
        )
        assert r.status == "completed"
        assert isinstance(r.output_parsed, Forecast)
        jsonschema.validate(json.loads(r.output_text), Forecast.model_json_schema())
        assert r.text is not None and r.text.format is not None
        assert r.text.format.type == "json_schema"
        spec.validate("Response", stored(srv, r.id))


# -- the store ---------------------------------------------------------------------------


def test_stored_responses_belong_to_their_key(srv: Server, spec: Spec) -> None:
    a = openai.OpenAI(base_url=srv.v1, api_key=KEY_A, max_retries=0, timeout=120)
    b = openai.OpenAI(base_url=srv.v1, api_key=KEY_B, max_retries=0, timeout=120)
    created = a.responses.create(
        model="tools", input="hello", max_output_tokens=16, temperature=0, reasoning=OFF
    )
    assert a.responses.retrieve(created.id).model_dump() == created.model_dump()
    spec.validate("Response", stored(srv, created.id))
    # Key B sees nothing: not the response, not a continuation, not a delete.
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as e:
        b.responses.create(
            model="tools", input="more", previous_response_id=created.id, max_output_tokens=16
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(created.id)
    # Key A continues it, then deletes it; after that it is gone for A too.
    more = a.responses.create(
        model="tools",
        input="more",
        previous_response_id=created.id,
        max_output_tokens=16,
        temperature=0,
        reasoning=OFF,
    )
    assert more.usage is not None and created.usage is not None
    assert more.usage.input_tokens > created.usage.input_tokens + created.usage.output_tokens
    a.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(created.id)
    # store: false keeps nothing.
    unstored = a.responses.create(
        model="tools", input="x", max_output_tokens=16, store=False, reasoning=OFF
    )
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


def test_unknown_ids_are_the_specs_404(srv: Server, spec: Spec) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{srv.v1}/responses/resp_unknown", headers=headers)
        assert r.status_code == 404
        spec.validate("ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "response_not_found"
    r = post(srv, {"input": "x", "previous_response_id": "resp_unknown", "max_output_tokens": 16})
    assert r.status_code == 404
    spec.validate("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == "previous_response_id"


# -- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tools": [{"type": "web_search"}]}, "function tools only"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "text only",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "not supported"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "previous_response_id"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"max_output_tokens": 8}, "max_output_tokens"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "not in tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
        ({"text": {"verbosity": "low"}}, "verbosity"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []},
            },
            "must name functions",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "web_search"}],
                },
            },
            "only function tools",
        ),
    ],
)
def test_refused_requests(srv: Server, spec: Spec, extra: dict[str, Any], message: str) -> None:
    r = post(srv, {"input": "hi", "max_output_tokens": 16, **extra})
    assert r.status_code == 400, r.text
    spec.validate("ErrorResponse", r.json())
    assert message in r.json()["error"]["message"]


def test_errors_name_this_apis_fields(srv: Server, spec: Spec) -> None:
    """Errors found on the chat path name the Responses field, not the chat one."""
    unique = {"type": "array", "uniqueItems": True}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": unique}}},
            "text.format",
        ),
        ({"max_output_tokens": 5000}, "max_output_tokens"),  # over the 4096-token context
    ]
    for extra, param in cases:
        r = post(srv, {"input": "hi", "max_output_tokens": 16, "reasoning": OFF, **extra})
        assert r.status_code == 400, r.text
        spec.validate("ErrorResponse", r.json())
        assert r.json()["error"]["param"] == param, r.json()


# -- failures -----------------------------------------------------------------------------


def test_worker_crash_mid_stream_is_response_failed(srv: Server, spec: Spec) -> None:
    """After the stream began, a lost worker ends it with `response.failed`."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    body = {
        "model": "tools",
        "input": "Go on",
        "max_output_tokens": 4000,
        "temperature": 0,
        "reasoning": OFF,
        "stream": True,
    }
    events: list[dict[str, Any]] = []
    crashed = False
    with httpx.stream("POST", srv.v1 + "/responses", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if events[-1]["type"] == "response.output_text.delta" and not crashed:
                fault = httpx.post(
                    f"{srv.url}/models/tools/fault", json={"kind": "crash"}, headers=headers
                )
                assert fault.status_code == 202, fault.text
                crashed = True
    for e in events:
        spec.validate(EVENT_SCHEMAS[e["type"]], e)
    final = events[-1]
    assert final["type"] == "response.failed", [e["type"] for e in events[-3:]]
    assert final["response"]["status"] == "failed"
    assert final["response"]["error"]["code"] == "server_error"
    assert "worker" in final["response"]["error"]["message"]
    assert final["sequence_number"] == len(events) - 1
    # The supervisor brings a new worker; wait for it (the next tests need it).
    deadline = time.monotonic() + 120
    while httpx.get(srv.url + "/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "no new worker"
        time.sleep(0.1)


# -- the OpenAI Agents SDK ----------------------------------------------------------------


def test_agent_runs_a_tool(srv: Server) -> None:
    agents = pytest.importorskip("agents")
    from openai.types.shared import Reasoning

    agents.set_tracing_disabled(True)  # no exporter, no network
    ran: list[str] = []

    # Offered until it has run: the second turn can then only answer (a random
    # model left a choice would call tools until max_turns).
    @agents.function_tool(is_enabled=lambda ctx, agent: not ran)
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(
        model="tools",
        openai_client=openai.AsyncOpenAI(base_url=srv.v1, api_key=KEY_A, max_retries=0),
    )
    agent = agents.Agent(
        name="forecaster",
        instructions="Call get_weather, then answer.",
        tools=[get_weather],
        model=model,
        output_type=Forecast,  # structured: the answer ends on its own
        # A random model will not choose the tool: force the first call (the
        # agent resets tool_choice after it).
        model_settings=agents.ModelSettings(
            tool_choice="required", max_tokens=96, temperature=0, reasoning=Reasoning(effort="none")
        ),
    )
    result = agents.Runner.run_sync(
        agent, "Weather in Paris?", max_turns=4, run_config=agents.RunConfig(tracing_disabled=True)
    )
    assert ran and set(ran) <= {"Paris", "Rome"}
    # Two model calls: the forced tool call, then the answer to its output.
    assert len(result.raw_responses) == 2
    assert isinstance(result.final_output, Forecast)
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and outputs[0].output == f"sunny in {ran[0]}"
