"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A Messages request (gateway/api/anthropic/schemas.py) is translated into the
equivalent chat request (gateway/api/anthropic/translate.py) and runs the same
path as /v1/chat/completions through the shared driver (gateway/api/driver.py):
admission, prepare (template, tokens, limits, constraints), Generation, the
reasoning/tool-call splitter. Only the rendering differs: content blocks
(`thinking`, `text`, `tool_use`), Anthropic stop reasons, usage, errors as
`{"type": "error", "error": {type, message}}`, and the event sequence of a stream:

    message_start, then per block content_block_start, content_block_delta...,
    content_block_stop, then message_delta (stop_reason, usage), message_stop.

Clients authenticate with `x-api-key` (gateway/http/auth.py accepts it as well as a
bearer token).

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from gateway.api.anthropic.schemas import (
    AnthropicError,
    AnthropicErrorDetail,
    AnthropicMessage,
    AnthropicUsage,
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
)
from gateway.api.anthropic.translate import to_chat
from gateway.api.driver import Admitted, admitted, collect, early_failure, pump
from gateway.api.openai.schemas import dump
from gateway.http.app_keys import MODELS, SETTINGS
from gateway.http.bodies import parse_body, read_json
from gateway.http.errors import APIError
from gateway.http.request_state import state
from gateway.http.slow_reader import SlowReader, cut_off, finish_bounded, mark_slow_reader
from gateway.http.sse import sse_event
from gateway.serving.chat import plan_chat
from gateway.serving.generation import Chunk, Generation, Prepared
from gateway.serving.requests import ChatCompletionRequest

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


# -- responses ----------------------------------------------------------------------


def error_payload(e: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    detail = AnthropicErrorDetail(type=kind, message=e.message)
    return dump(AnthropicError(type="error", error=detail))


def _error_response(request: web.Request, e: APIError) -> web.Response:
    state(request).error = e.message
    return web.json_response(error_payload(e), status=e.status, headers=e.headers)


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return sse_event({"type": name, **payload}, event=name)


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


def _usage(prepared: Prepared, gen: Generation) -> AnthropicUsage:
    # Anthropic counts prompt tokens read from the cache apart from input_tokens.
    return AnthropicUsage(
        input_tokens=len(prepared.prompt) - gen.cached_tokens,
        output_tokens=gen.completion_tokens,
        cache_read_input_tokens=gen.cached_tokens,
        cache_creation_input_tokens=0,
    )


# -- handlers -----------------------------------------------------------------------


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    try:
        body = parse_body(MessagesRequest, await read_json(request))
        chat = parse_body(ChatCompletionRequest, to_chat(body))
        return await _generate(request, body, chat)
    except APIError as e:
        resp = await early_failure(request, e, _event("error", error_payload(e)))
        return resp or _error_response(request, e)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.StreamResponse:
    try:
        body = parse_body(CountTokensRequest, await read_json(request))
        chat = parse_body(ChatCompletionRequest, {**to_chat(body), "max_tokens": 1})
        registry = request.app[MODELS]
        hosted = registry.resolve(body.model)
        deadline = time.monotonic() + request.app[SETTINGS].request_timeout_s
        # Counting tokenizes like a generation does, so it is admitted like one:
        # a queue position (503 when full) and an in-flight slot while it counts.
        ticket = hosted.admission.enter()
        try:
            # Counting needs the model's tokenizer: a stopped model starts for it.
            async with registry.lease(hosted, deadline) as served:
                await served.acquire_client(max(0.0, deadline - time.monotonic()))
                frontend = served.frontend
                assert frontend is not None
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await ticket.acquire()
                except TimeoutError:
                    raise APIError(
                        504, "no in-flight slot to count tokens in time", code="timeout"
                    ) from None
                plan = await plan_chat(chat, frontend)
        finally:
            ticket.release()
        return web.json_response(dump(TokenCount(input_tokens=len(plan.prompt))))
    except APIError as e:
        return _error_response(request, e)


async def _generate(
    request: web.Request, body: MessagesRequest, chat: ChatCompletionRequest
) -> web.StreamResponse:
    """Admission and preparation as for every API (gateway/api/driver.py), then the answer."""
    async with admitted(request, body.model, body.stream, chat) as a:
        gen = a.generation(request)
        if body.stream:
            return await _stream(request, body, gen, a)
        return await _complete(request, body, gen, a)


def _message_id(request: web.Request) -> str:
    return "msg_" + state(request).request_id


def _content(chunks: list[Chunk]) -> list[ContentBlock]:
    content: list[ContentBlock] = []
    reasoning = "".join(c.reasoning for c in chunks)
    if reasoning:
        content.append(ContentBlock(type="thinking", thinking=reasoning, signature=""))
    text = "".join(c.text for c in chunks)
    if text:
        content.append(ContentBlock(type="text", text=text))
    for c in chunks:
        for call in c.tool_calls:
            name = call["function"]["name"]
            content.append(
                ContentBlock(type="tool_use", id=call["id"], name=name, input=_tool_input(call))
            )
    return content


async def _complete(
    request: web.Request, body: MessagesRequest, gen: Generation, a: Admitted
) -> web.StreamResponse:
    chunks = await collect(request, gen, model=body.model, deadline=a.deadline)
    stop_reason, stop_sequence = _stop(gen)
    payload = AnthropicMessage(
        id=_message_id(request),
        type="message",
        role="assistant",
        model=body.model,
        content=_content(chunks),
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=_usage(a.prepared, gen),
    )
    gen.trace.first_byte = time.monotonic()
    return await finish_bounded(request, web.json_response(dump(payload)))


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
            out.append(self.delta({"type": "signature_delta", "signature": ""}))
        out.append(_event("content_block_stop", {"index": self.index}))
        self.kind = None
        return out

    def open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

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

    def end(self, gen: Generation, prepared: Prepared) -> bytes:
        """The close of the last block, message_delta and message_stop."""
        tail = self.close()
        stop_reason, stop_sequence = _stop(gen)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        tail.append(_event("message_delta", {"delta": delta, "usage": dump(_usage(prepared, gen))}))
        tail.append(_event("message_stop", {}))
        return b"".join(tail)


def _message_start(request: web.Request, body: MessagesRequest, prepared: Prepared) -> bytes:
    start: dict[str, Any] = {
        "id": _message_id(request),
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(prepared.prompt), "output_tokens": 0},
    }
    return _event("message_start", {"message": start}) + _event("ping", {})


async def _stream(
    request: web.Request, body: MessagesRequest, gen: Generation, a: Admitted
) -> web.StreamResponse:
    blocks = _Blocks()
    try:
        async with gen:
            out = a.stream(_message_start(request, body, a.prepared))
            ended = await pump(
                request,
                gen,
                out,
                model=body.model,
                deadline=a.deadline,
                render=lambda c: b"".join(blocks.events(c)),
                error_event=lambda e: _event("error", error_payload(e)),
            )
            if ended:
                await out.write(blocks.end(gen, a.prepared))
        return await out.end()
    except SlowReader as e:  # the Generation context has aborted it in the worker
        gen.finish_reason = e.finish_reason
        mark_slow_reader(request, e)
        final = _event("error", error_payload(APIError(408, str(e))))
        await cut_off(request, e.response, final)
        return e.response
