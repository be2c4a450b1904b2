"""Anthropic Messages requests in the canonical chat request's terms.

`to_chat` turns a Messages (or count_tokens) body into the equivalent
/v1/chat/completions body (gateway/serving/requests.ChatCompletionRequest):
system -> a system message, tool_use blocks -> assistant tool_calls, tool_result
blocks -> tool messages, tools and tool_choice, `thinking` -> enable_thinking and
thinking_budget, `output_config.format` json_schema -> response_format. A block
this server cannot use is a 400 naming where it is.

Threading: pure functions, any thread.
"""

from __future__ import annotations

from typing import Any

from gateway.api.anthropic.schemas import Block, CountTokensRequest, MessagesRequest
from gateway.http.errors import APIError


def _text_of(content: str | list[Block] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for b in content:
        if b.type != "text" or b.text is None:
            raise APIError(400, f"{where}: content block type {b.type!r} is not supported here")
        parts.append(b.text)
    return "".join(parts)


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of a Messages request: system first, blocks translated."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, reasoning, calls = [], [], []
        for b in m.content:
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "thinking" and m.role == "assistant":
                reasoning.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                continue  # opaque; nothing a local model can use
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name or "", "arguments": b.input or {}},
                    }
                )
            elif b.type == "tool_result" and m.role == "user":
                result = _text_of(b.content, where)
                if b.is_error:
                    result = f"Error: {result}"
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
            else:
                raise APIError(400, f"{where}: content block type {b.type!r} is not supported")
        if text or calls or reasoning or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            messages.append(msg)
    return messages


def _tools(body: CountTokensRequest, chat: dict[str, Any]) -> None:
    """Tools, tool_choice and thinking, in the chat request's terms."""
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
        choice = body.tool_choice
        if choice is not None:
            chat["tool_choice"] = {
                "auto": "auto",
                "any": "required",
                "none": "none",
                "tool": {"type": "function", "function": {"name": choice.name}},
            }[choice.type]
            chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.thinking is not None:
        if body.thinking.type == "disabled":
            chat["enable_thinking"] = False
        else:
            chat["enable_thinking"] = True
            if body.thinking.budget_tokens:
                chat["thinking_budget"] = body.thinking.budget_tokens


def to_chat(body: CountTokensRequest) -> dict[str, Any]:
    """The equivalent /v1/chat/completions body (validated by ChatCompletionRequest)."""
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    _tools(body, chat)
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, temperature=body.temperature, stream=body.stream)
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
        if body.top_p is not None:
            chat["top_p"] = body.top_p
        if body.top_k is not None:
            chat["top_k"] = body.top_k
        if body.output_config is not None and body.output_config.format is not None:
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": body.output_config.format.schema_},
            }
    return chat
