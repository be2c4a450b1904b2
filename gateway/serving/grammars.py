"""Grammars for constrained decoding: response_format and forced tool calls.

The gateway turns a request's `response_format` (`json_object`, `json_schema`) or a
forced tool call (`tool_choice` `required` or a named function) into an llguidance
grammar string, validates it here (an unsupported schema is a 400 before anything
is queued), and sends it to the worker in `Add.constraint` (worker/constraints.py
compiles it against the model's tokenizer and masks every decoding step).

JSON is generated compact (no free whitespace between tokens): a free whitespace
rule lets a weak model pad forever, and every JSON parser reads compact JSON.

Why llguidance (docs/api.md#structured-output has the measurements): no per-schema
precompilation (a schema is ready in about 2 ms where outlines-core builds a regex
index for about a second), the widest JSON Schema coverage with clear errors for
the rest, Lark grammars with embedded JSON schemas (tool-call markers around JSON
arguments), and no torch dependency (xgrammar needs torch).

Threading: pure functions; `validate` runs in the tokenizer pool (a large schema
takes milliseconds to compile).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gateway.http.errors import APIError
from gateway.serving.requests import FunctionDef, ResponseFormat

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON, all of JSON Schema that llguidance implements, nothing ignored.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# At most this many calls when parallel tool calls are allowed: bounds the output
# of a model that would otherwise repeat calls until max_tokens.
MAX_PARALLEL_CALLS = 8


def compact_json(value: Any) -> str:
    """JSON for the worker's constraint and Lark's %json: no spaces, and UTF-8
    rather than ASCII escapes (a non-ASCII character costs 2-4 bytes, not 6-12,
    so a schema that fits the body limit stays under the IPC frame limit).
    Safe: read_json already refused lone surrogates, the one thing UTF-8 cannot
    carry."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_grammar(schema: dict[str, Any]) -> str:
    import llguidance

    try:
        grammar: str = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise APIError(400, f"invalid JSON schema: {e}", param="response_format") from None
    return grammar


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema a response_format asks for; None for text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    assert fmt.json_schema is not None and fmt.json_schema.schema_ is not None
    return fmt.json_schema.schema_


def call_schema(functions: list[FunctionDef]) -> dict[str, Any]:
    """The JSON of one Hermes-style call: {"name": ..., "arguments": {...}}."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": f.parameters if f.parameters is not None else {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def lark_marker(text: str, ids: list[int], added: bool) -> str:
    """A marker in Lark: the token itself when it is one added token, else its text.

    llguidance treats added tokens (`<tool_call>` in Qwen's vocabulary) as special:
    they match only as `<[id]>`, never as the bytes of their text.
    """
    if len(ids) == 1 and added:
        return f"<[{ids[0]}]>"
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def tool_call_grammar(
    functions: list[FunctionDef],
    markers: tuple[str, str],
    parallel: bool,
    alternative: dict[str, Any] | None = None,
) -> str:
    """Lark: one call (or up to MAX_PARALLEL_CALLS) wrapped in the model's markers.

    `markers` are Lark fragments (`lark_marker`).
    `alternative`: a response schema the model may answer with instead of calling
    a tool (tool_choice `auto` together with response_format).
    """
    import llguidance

    start, end = markers
    schema = {**call_schema(functions), "x-guidance": JSON_OPTIONS}
    calls = f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else "call"
    lines = [
        f"calls: {calls}",
        f'call: {start} "\\n" call_json "\\n" {end}',
        f"call_json: %json {compact_json(schema)}",
    ]
    if alternative is not None:
        lines.insert(0, "start: calls | answer")
        lines.append(f"answer: %json {compact_json({**alternative, 'x-guidance': JSON_OPTIONS})}")
    else:
        lines.insert(0, "start: calls")
    grammar: str = llguidance.LLMatcher.grammar_from_lark("\n".join(lines))
    return grammar


def validate(grammar: str, param: str) -> None:
    """400 naming the problem when llguidance cannot run the grammar."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        detail = " ".join(error.split())[:500]
        raise APIError(
            400,
            f"{param}: the schema is not supported for constrained decoding: {detail}",
            param=param,
        )
