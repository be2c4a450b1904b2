"""Tool calling on the request side: what the chat template sees, and what is allowed.

- `template_messages` turns OpenAI messages into the dicts Hugging Face chat
  templates expect: assistant `tool_calls` with `arguments` as an object (OpenAI
  sends a JSON string; templates render it with `tojson`), `tool` results with
  their `tool_call_id`, and an earlier turn's `reasoning_content`.
- `template_tools` is the `tools` list the template renders.
- `forced_call_markers` decides whether a call can be forced by a grammar
  (`tool_choice` `required` or a named function): only for models whose calls
  are JSON between markers (mlx-lm's `json_tools` parser, Hermes/Qwen style).

The model's output is parsed back into tool calls by gateway/serving/reasoning.py with
the model's mlx-lm tool parser.

Threading: pure functions.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.http.errors import APIError
from gateway.serving.grammars import lark_marker
from gateway.serving.requests import ChatMessage, Tool
from gateway.serving.tokenizer import Frontend

# mlx-lm parsers whose calls are `<start>\n{"name": ..., "arguments": {...}}\n<end>`.
JSON_CALL_PARSERS = frozenset({"json_tools"})


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def _arguments(fn: Any) -> Any:
    args = fn.arguments
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args  # a template can still render the raw string
    return args


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def require_tool_support(frontend: Frontend) -> None:
    if not frontend.has_tool_calling:
        raise APIError(
            400,
            "this model does not support tool calling: its chat template and tokenizer "
            "have no tool-call format that mlxd can parse",
            param="tools",
        )


def forced_call_markers(frontend: Frontend) -> tuple[str, str]:
    """The markers (Lark fragments) a forced call is written between; 400 for other formats."""
    if frontend.tool_parser_name not in JSON_CALL_PARSERS:
        raise APIError(
            400,
            f"tool_choice 'required' or a named function needs a model whose tool calls are "
            f"JSON between markers; this model's format ({frontend.tool_parser_name}) can only "
            f"be used with tool_choice 'auto'",
            param="tool_choice",
        )
    assert frontend.tool_start is not None and frontend.tool_end is not None
    return _marker(frontend, frontend.tool_start), _marker(frontend, frontend.tool_end)


def _marker(frontend: Frontend, text: str) -> str:
    ids = frontend.marker_ids(text)
    return lark_marker(text, ids, len(ids) == 1 and ids[0] in frontend.added_ids)
