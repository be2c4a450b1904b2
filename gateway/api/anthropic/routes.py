"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A Messages request is translated into the equivalent chat request
(gateway/serving/requests.ChatCompletionRequest: system -> a system message, tool_use
blocks -> assistant tool_calls, tool_result blocks -> tool messages, tools and
tool_choice, `thinking` -> enable_thinking and thinking_budget) and runs the same
path as /v1/chat/completions: admission, prepare (template, tokens, limits,
constraints), Generation, the reasoning/tool-call splitter. Only the rendering
differs: content blocks (`thinking`, `text`, `tool_use`), Anthropic stop reasons,
usage, errors as `{"type": "error", "error": {type, message}}`, structured outputs
(`output_config.format` json_schema -> response_format), and the event
sequence of a stream:

    message_start, then per block content_block_start, content_block_delta...,
    content_block_stop, then message_delta (stop_reason, usage), message_stop.

Clients authenticate with `x-api-key` (gateway/http/auth.py accepts it as well as a
bearer token).

Threading: event loop only.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.api.openai.routes import (
    _SSEWriter,
    admitted,
    collect,
    early_sse_error,
    parse_body,
    pump,
    read_json,
    sse_response,
)
from gateway.http.app_keys import MODELS, SETTINGS
from gateway.http.errors import APIError
from gateway.http.slow_reader import (
    SlowReader,
    cut_off,
    finish_bounded,
    mark_slow_reader,
    write_eof_bounded,
)
from gateway.serving.chat import plan_chat
from gateway.serving.generation import Chunk, Generation, Prepared
from gateway.serving.requests import ChatCompletionRequest
from gateway.workers.client import WorkerClient

routes = web.RouteTableDef()

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# -- request bodies ---------------------------------------------------------------


class Block(BaseModel):
    """One content block; which fields matter depends on `type`."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs: the answer is JSON matching `format.schema`."""

    model_config = ConfigDict(extra="ignore")
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _checks(self) -> CountTokensRequest:
        for t in self.tools or []:
            if t.type not in (None, "custom"):
                raise ValueError(f"tool type {t.type!r} is not supported (custom tools only)")
        choice = self.tool_choice
        if (
            choice is not None
            and choice.type == "tool"
            and not any(t.name == choice.name for t in self.tools or [])
        ):
            raise ValueError("tool_choice names a tool that is not in tools")
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


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


def to_chat(body: CountTokensRequest) -> dict[str, Any]:
    """The equivalent /v1/chat/completions body (validated by ChatCompletionRequest)."""
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
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
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


# -- responses ----------------------------------------------------------------------


def error_payload(e: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _error_response(request: web.Request, e: APIError) -> web.Response:
    request["error"] = e.message
    return web.json_response(error_payload(e), status=e.status, headers=e.headers)


def _event(name: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


def _tool_input(call: dict[str, Any]) -> dict[str, Any]:
    try:
        value = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        value = {"_raw": call["function"]["arguments"]}
    return value if isinstance(value, dict) else {"value": value}


def _stop(gen: Generation) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished generation."""
    reason = gen.finish_reason
    matched = gen.text.matched
    if reason == "stop" and matched is not None:
        return "stop_sequence", matched
    return _STOP_REASONS.get(reason or "", "end_turn"), None


def _usage(prepared: Prepared, gen: Generation) -> dict[str, Any]:
    # Anthropic counts prompt tokens read from the cache apart from input_tokens.
    return {
        "input_tokens": len(prepared.prompt) - gen.cached_tokens,
        "output_tokens": gen.completion_tokens,
        "cache_read_input_tokens": gen.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


# -- handlers -----------------------------------------------------------------------


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    try:
        body = parse_body(MessagesRequest, await read_json(request))
        chat = parse_body(ChatCompletionRequest, to_chat(body))
        return await _generate(request, body, chat)
    except APIError as e:
        early = await early_sse_error(request, e, _event("error", error_payload(e)))
        return early or _error_response(request, e)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.StreamResponse:
    try:
        body = parse_body(CountTokensRequest, await read_json(request))
        chat = parse_body(ChatCompletionRequest, {**to_chat(body), "max_tokens": 1})
        registry = request.app[MODELS]
        slot = registry.resolve(body.model)
        deadline = time.monotonic() + request.app[SETTINGS].request_timeout_s
        # Counting needs the model's tokenizer: a stopped model starts for it.
        async with registry.lease(slot, deadline) as served:
            await served.acquire_client(max(0.0, deadline - time.monotonic()))
            frontend = served.frontend
            assert frontend is not None
            plan = await plan_chat(chat, frontend)
        return web.json_response({"input_tokens": len(plan.prompt)})
    except APIError as e:
        return _error_response(request, e)


async def _generate(
    request: web.Request, body: MessagesRequest, chat: ChatCompletionRequest
) -> web.StreamResponse:
    """Admission and preparation exactly as gateway/api/openai/routes does, then the answer."""
    async with admitted(request, body.model, body.stream, chat) as a:
        gen = a.generation(request)
        if body.stream:
            return await _stream(request, body, gen, a.prepared, a.client, a.deadline)
        return await _complete(request, body, gen, a.prepared, a.deadline)


def _message_base(request: web.Request, body: MessagesRequest) -> dict[str, Any]:
    return {
        "id": "msg_" + request["request_id"],
        "type": "message",
        "role": "assistant",
        "model": body.model,
    }


async def _complete(
    request: web.Request,
    body: MessagesRequest,
    gen: Generation,
    prepared: Prepared,
    deadline: float,
) -> web.StreamResponse:
    chunks = await collect(request, gen, model=body.model, deadline=deadline)
    content: list[dict[str, Any]] = []
    reasoning = "".join(c.reasoning for c in chunks)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = "".join(c.text for c in chunks)
    if text:
        content.append({"type": "text", "text": text})
    for c in chunks:
        for call in c.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": _tool_input(call),
                }
            )
    stop_reason, stop_sequence = _stop(gen)
    payload = {
        **_message_base(request, body),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(prepared, gen),
    }
    gen.trace.first_byte = time.monotonic()
    return await finish_bounded(request, web.json_response(payload))


class _Blocks:
    """The content blocks of one streamed message: opens and closes them in order."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(
                _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "signature_delta", "signature": ""},
                    },
                )
            )
        out.append(
            _event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        )
        self.kind = None
        return out

    def open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )
        return out

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def events(self, c: Chunk) -> list[bytes]:
        out: list[bytes] = []
        if c.reasoning:
            if self.kind != "thinking":
                out += self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.delta({"type": "thinking_delta", "thinking": c.reasoning}))
        if c.text:
            if self.kind != "text":
                out += self.open("text", {"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": c.text}))
        for call in c.tool_calls:
            block = {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": {},
            }
            out += self.open("tool_use", block)
            partial = json.dumps(_tool_input(call), ensure_ascii=False)
            out.append(self.delta({"type": "input_json_delta", "partial_json": partial}))
            out += self.close()
        return out


async def _stream(
    request: web.Request,
    body: MessagesRequest,
    gen: Generation,
    prepared: Prepared,
    client: WorkerClient,
    deadline: float,
) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    resp = request.get("sse") or sse_response()
    start = {
        **_message_base(request, body),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(prepared.prompt), "output_tokens": 0},
    }
    first = _event("message_start", {"type": "message_start", "message": start})
    first += _event("ping", {"type": "ping"})
    blocks = _Blocks()
    try:
        async with gen:
            out = _SSEWriter(request, resp, first, gen.trace, settings.sse_keepalive_s)
            ended = await pump(
                request,
                gen,
                out,
                model=body.model,
                deadline=deadline,
                render=lambda c: b"".join(blocks.events(c)),
                error_event=lambda e: _event("error", error_payload(e)),
            )
            if not ended:
                return await _end(out, resp)
            tail = blocks.close()
            stop_reason, stop_sequence = _stop(gen)
            usage = _usage(prepared, gen)
            tail.append(
                _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": usage,
                    },
                )
            )
            tail.append(_event("message_stop", {"type": "message_stop"}))
            await out.write(b"".join(tail))
        return await _end(out, resp)
    except SlowReader as e:  # the Generation context has aborted it in the worker
        gen.finish_reason = e.finish_reason
        mark_slow_reader(request, e)
        final = _event("error", error_payload(APIError(408, str(e))))
        await cut_off(request, e.response, final)
        return e.response


async def _end(out: _SSEWriter, resp: web.StreamResponse) -> web.StreamResponse:
    await write_eof_bounded(resp, out.slow_reader_s)
    return resp
