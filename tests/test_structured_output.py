"""Structured output: response_format json_object / json_schema, enforced while decoding.

A random-weight model writes nonsense, so any valid output is the constraint's
doing: every answer must parse and validate against its schema (jsonschema).
Also the worker-side processor on its own (thinking budget, EOS only when the
grammar is complete) and the 400s for schemas llguidance cannot run.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import TOOLS_KEY, Server

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "active": {"type": "boolean"},
        "status": {"enum": ["new", "open", "closed"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {
                        "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                        "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                    },
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "zip", "geo"],
            "additionalProperties": False,
        },
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
    },
    "required": ["name", "age", "score", "active", "status", "tags", "address", "note"],
    "additionalProperties": False,
}


def fmt(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": strict},
    }


@pytest.fixture(scope="module")
def client(tools_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.v1, api_key=TOOLS_KEY, max_retries=0, timeout=120)


def test_fifty_random_requests_all_valid(client: openai.OpenAI) -> None:
    rng = random.Random(7)
    prompts = [
        " ".join(
            rng.choice(["tell", "me", "about", "a", "person", "city", "now"]) for _ in range(6)
        )
        for _ in range(50)
    ]

    def one(i: int) -> tuple[str, str | None]:
        r = client.chat.completions.create(
            model="tools",
            messages=[{"role": "user", "content": prompts[i]}],
            response_format=fmt(NESTED),  # type: ignore[arg-type]
            max_tokens=400,
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            seed=i,
            extra_body={"enable_thinking": False},
        )
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(50)))
    for content, finish in results:
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), NESTED)
    assert len({c for c, _ in results}) > 10  # the values really vary


def test_streaming_json_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=0.5,
        seed=5,
        stream=True,
        extra_body={"enable_thinking": False},
    )
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":  # an object with free keys may run to max_tokens
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.startswith("{")


def test_completions_response_format(tools_server: Server) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 4}
    r = httpx.post(
        f"{tools_server.v1}/completions",
        headers={"Authorization": f"Bearer {TOOLS_KEY}"},
        json={
            "model": "tools",
            "prompt": "list:",
            "max_tokens": 40,
            "temperature": 1.0,
            "response_format": fmt(schema),
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (fmt({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (fmt({"type": "string", "format": "no-such-format"}), "no-such-format"),
        (fmt({"type": "string", "pattern": "(?<=a)b"}), "look-around"),
        (fmt({"$ref": "http://example.com/s.json"}), "not supported"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "xml"}, "response_format"),
    ],
)
def test_unsupported_schemas_are_400(
    client: openai.OpenAI, response_format: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            model="tools",
            messages=[{"role": "user", "content": "hi"}],
            response_format=response_format,  # type: ignore[arg-type]
            max_tokens=4,
        )


# -- the worker's processor in-process -------------------------------------------------


@pytest.fixture(scope="module")
def core(tiny_tools_model_dir: Path):  # type: ignore[no-untyped-def]
    from worker.core import EngineCore
    from worker.runner import Runner
    from worker.scheduler import SchedulerConfig

    runner = Runner(tiny_tools_model_dir, max_batch=16, prefill_batch=8, prefill_chunk=512)
    return EngineCore(
        runner,
        SchedulerConfig(max_batch=16, prefill_batch=8, prefill_chunk=512),
        memory_budget_bytes=8 << 30,
    )


def run(core: Any, adds: list[Any]) -> dict[str, Any]:
    for a in adds:
        core.add(a)
    outs: dict[str, Any] = {}
    while core.has_work():
        step = core.step()
        for o in step.outputs if step else []:
            acc = outs.setdefault(o.request_id, {"ids": [], "finish": None, "error": ""})
            acc["ids"] += o.token_ids
            acc["finish"], acc["error"] = o.finish_reason, o.error
    return outs


def test_processor_budget_grammar_and_eos(core: Any) -> None:
    import llguidance

    from protocol.messages import Add, SamplingParams

    think_start, think_end, eos = 508, 509, core.runner.info.eos_token_ids
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        {**schema, "required": ["n"], "additionalProperties": False},
        defaults={"whitespace_flexible": False},
    )
    reasoning = {"start": [think_start], "end": [think_end], "active": True, "budget": 4}
    prompt = [5, 6, 7, 8]
    outs = run(
        core,
        [
            Add(
                "budget",
                prompt,
                12,
                SamplingParams(temperature=0.0),
                constraint=json.dumps({"reasoning": reasoning}),
            ),
            Add(
                "both",
                prompt,
                40,
                SamplingParams(temperature=1.0, seed=1),
                constraint=json.dumps({"grammar": grammar, "reasoning": reasoning}),
            ),
            Add("bad", prompt, 4, SamplingParams(), constraint='{"grammar": "start: ((("}'),
            Add("empty", prompt, 4, SamplingParams(), constraint="{}"),
            Add("plain", prompt, 6, SamplingParams(temperature=0.0)),
        ],
    )
    # Budget only: four reasoning tokens, then the end marker is forced.
    ids = outs["budget"]["ids"]
    assert think_end in ids and (ids.index(think_end) == 4 or ids[-1] in eos)
    # Grammar after the budget: no EOS inside the block, valid JSON after it.
    ids = outs["both"]["ids"]
    assert ids.index(think_end) == 4 and not set(ids[:4]) & set(eos)
    assert outs["both"]["finish"] == "stop" and ids[-1] in eos
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(core.runner.info.path)
    assert json.loads(tok.decode(ids[5:-1]))["n"] <= 9
    assert outs["bad"]["finish"] == "rejected" and "grammar" in outs["bad"]["error"]
    assert outs["empty"]["finish"] == "rejected"
    assert len(outs["plain"]["ids"]) <= 6
    assert core.runner.active == 0


def test_add_constraint_on_the_wire() -> None:
    import msgpack

    from protocol.messages import Add, SamplingParams, decode_body, encode_message

    add = Add("r", [1, 2], 8, SamplingParams(), constraint='{"grammar": "start: \\"a\\""}')
    assert decode_body(Add.TYPE, encode_message(add)[12:]) == add
    # An older gateway's Add (no trailing field) means no constraint.
    old = decode_body(Add.TYPE, msgpack.packb(["r", [1, 2], 8, [], [], 0, False, 0]))
    assert isinstance(old, Add) and old.constraint == ""
