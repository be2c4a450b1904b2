"""A Responses API request in the canonical chat request's terms (gateway/serving/requests.py).

`to_chat` turns a CreateResponseRequest and the stored conversation it continues
(previous_response_id) into the equivalent /v1/chat/completions body: input items
-> chat messages, function tools and tool_choice, text.format -> response_format,
reasoning.effort -> enable_thinking.

Threading: pure functions, any thread.
"""

from __future__ import annotations

from typing import Any

from gateway.api.openai.responses_schemas import (
    CHAT_EXTENSIONS,
    CreateResponseRequest,
    ResponsesInputItem,
    ResponsesToolChoiceAllowed,
    ResponsesToolChoiceFunction,
)
from gateway.http.errors import APIError

# -- the equivalent chat request ---------------------------------------------------------


def _messages(items: list[ResponsesInputItem]) -> list[dict[str, Any]]:
    """Chat messages for a conversation's items (reasoning and calls join their turn)."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being assembled

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for item in items:
        if item.type == "reasoning":
            msg = assistant()
            msg["reasoning_content"] = msg.get("reasoning_content", "") + item.text()
        elif item.type == "function_call":
            msg = assistant()
            call = {"name": item.name, "arguments": item.arguments}
            msg.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
        elif item.type == "function_call_output":
            turn = None
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif item.role == "assistant":
            msg = assistant()
            if msg.get("tool_calls"):  # text after the calls starts a new turn
                turn = None
                msg = assistant()
            msg["content"] += item.text()
        else:
            turn = None
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
    return messages


def _tools(body: CreateResponseRequest) -> dict[str, Any]:
    """The chat body's tools, tool_choice and parallel_tool_calls."""
    tools = body.tools or []
    choice = body.tool_choice
    if isinstance(choice, ResponsesToolChoiceAllowed):
        allowed = choice.names()
        tools = [t for t in tools if t.name in allowed]
        choice = choice.mode
    if not tools:
        return {}
    out: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": t.strict,
                },
            }
            for t in tools
        ]
    }
    if isinstance(choice, ResponsesToolChoiceFunction):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        out["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


def to_chat(body: CreateResponseRequest, context: list[ResponsesInputItem]) -> dict[str, Any]:
    """The /v1/chat/completions body equivalent to `body` continuing `context`."""
    messages = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages += _messages(context + body.input_items())
    if not messages:
        raise APIError(400, "input must not be empty", param="input")
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream)}
    chat.update(_tools(body))
    fmt = body.text_format
    if fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        chat["enable_thinking"] = effort != "none"
    for name, value in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
    ):
        if value is not None:
            chat[name] = value
    extra = body.model_extra or {}
    chat.update({k: extra[k] for k in CHAT_EXTENSIONS if extra.get(k) is not None})
    return chat
