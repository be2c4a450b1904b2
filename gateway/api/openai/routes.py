"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Handlers parse and validate the body (gateway/http/bodies.py) into the canonical
request (gateway/serving/requests.py), run it through the shared driver
(gateway/api/driver.py: admission, preparation, deadline, collect or pump), and
render OpenAI's shapes: a JSON answer built from the response models
(gateway/api/openai/schemas.py), or SSE chunks (`data: {...}` ... `data: [DONE]`).

Threading: event loop only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.api.driver import Admitted, admitted, collect, early_failure, pump
from gateway.api.openai.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    Model,
    ModelList,
    Usage,
    dump,
)
from gateway.http.app_keys import MODELS
from gateway.http.bodies import parse_body, read_json
from gateway.http.errors import APIError
from gateway.http.request_state import state
from gateway.http.slow_reader import SlowReader, cut_off, finish_bounded, mark_slow_reader
from gateway.http.sse import DONE, slow_reader_event, sse_event
from gateway.serving.generation import Chunk, Generation, Prepared
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest
from gateway.serving.tokenizer import Frontend
from gateway.workers.registry import ModelSlot

routes = web.RouteTableDef()


def _usage(prepared: Prepared, gen: Generation) -> Usage:
    n = len(prepared.prompt)
    return Usage(
        prompt_tokens=n,
        completion_tokens=gen.completion_tokens,
        total_tokens=n + gen.completion_tokens,
        prompt_tokens_details={"cached_tokens": gen.cached_tokens},
    )


# -- logprobs shapes -----------------------------------------------------------


def _chat_logprobs(frontend: Frontend, c: Chunk) -> list[dict[str, Any]]:
    out = []
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs or [], strict=False)):
        text = frontend.token_text(tok)
        tops = (c.top_logprobs or [])[i] if c.top_logprobs and i < len(c.top_logprobs) else []
        out.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := frontend.token_text(int(tid))),
                        "logprob": v,
                        "bytes": list(t.encode()),
                    }
                    for tid, v in tops
                ],
            }
        )
    return out


def _completion_logprobs(frontend: Frontend, chunks: list[Chunk]) -> dict[str, Any]:
    tokens, lps, tops = [], [], []
    for c in chunks:
        for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs or [], strict=False)):
            tokens.append(frontend.token_text(tok))
            lps.append(lp)
            t = (c.top_logprobs or [])[i] if c.top_logprobs and i < len(c.top_logprobs) else []
            tops.append({frontend.token_text(int(tid)): v for tid, v in t})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": []}


# -- reasoning and tool calls (gateway/serving/reasoning.py) ---------------------


def _message(chunks: list[Chunk]) -> AssistantMessage:
    """A chat answer's message: content, and its reasoning_content and tool_calls."""
    message = AssistantMessage(role="assistant", content="".join(c.text for c in chunks))
    reasoning = "".join(c.reasoning for c in chunks)
    calls = [{k: v for k, v in t.items() if k != "index"} for c in chunks for t in c.tool_calls]
    if reasoning:
        message.reasoning_content = reasoning
    if calls:
        message.tool_calls = calls
        message.content = message.content or None
    return message


def _delta_channels(delta: dict[str, Any], c: Chunk) -> None:
    if c.reasoning:
        delta["reasoning_content"] = c.reasoning
    if c.tool_calls:
        delta["tool_calls"] = c.tool_calls
        delta["content"] = delta["content"] or None


# -- handlers -------------------------------------------------------------------


@dataclass(slots=True)
class _Answer:
    """What every part of one answer shares."""

    request: web.Request
    body: ChatCompletionRequest | CompletionRequest
    chat: bool
    a: Admitted
    gen: Generation
    created: int

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + state(self.request).request_id

    @property
    def fingerprint(self) -> str:
        return "mlxd-" + self.a.client.ready.identity


async def _generate(
    request: web.Request, body: ChatCompletionRequest | CompletionRequest, chat: bool
) -> web.StreamResponse:
    try:
        async with admitted(request, body.model, body.stream, body) as a:
            answer = _Answer(request, body, chat, a, a.generation(request), int(time.time()))
            if not body.stream:
                return await _complete(answer)
            try:
                return await _stream(answer)
            except SlowReader as e:  # the Generation context has aborted it in the worker
                answer.gen.finish_reason = e.finish_reason
                mark_slow_reader(request, e)
                await cut_off(request, e.response, slow_reader_event(e))
                return e.response
    except APIError as e:
        resp = await early_failure(request, e, sse_event(e.body()) + sse_event(DONE))
        if resp is None:
            raise
        return resp


async def _complete(answer: _Answer) -> web.StreamResponse:
    body, gen, a = answer.body, answer.gen, answer.a
    chunks = await collect(answer.request, gen, model=body.model, deadline=a.deadline)
    token_ids = [t for c in chunks for t in c.token_ids] if body.return_token_ids else None
    logprobs = a.prepared.top_logprobs is not None
    common: dict[str, Any] = {
        "id": answer.id,
        "created": answer.created,
        "model": body.model,
        "system_fingerprint": answer.fingerprint,
        "usage": _usage(a.prepared, gen),
    }
    if body.return_token_ids:
        common["prompt_token_ids"] = a.prepared.prompt
    choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    payload: ChatCompletion | Completion
    if answer.chat:
        if logprobs:
            choice["logprobs"] = {
                "content": [x for c in chunks for x in _chat_logprobs(a.frontend, c)]
            }
        choices = [ChatChoice(message=_message(chunks), **choice)]
        payload = ChatCompletion(object="chat.completion", choices=choices, **common)
    else:
        if logprobs:
            choice["logprobs"] = _completion_logprobs(a.frontend, chunks)
        text = "".join(c.text for c in chunks)
        choices_ = [CompletionChoice(text=text, **choice)]
        payload = Completion(object="text_completion", choices=choices_, **common)
    gen.trace.first_byte = time.monotonic()
    return await finish_bounded(answer.request, web.json_response(dump(payload)))


class _Chunks:
    """The SSE chunks of one streamed answer."""

    def __init__(self, answer: _Answer) -> None:
        body = answer.body
        self.answer = answer
        self.base = {
            "id": answer.id,
            "object": "chat.completion.chunk" if answer.chat else "text_completion",
            "created": answer.created,
            "model": body.model,
            "system_fingerprint": answer.fingerprint,
        }
        self.logprobs = answer.a.prepared.top_logprobs is not None
        # A token may add no text yet (held-back space or partial UTF-8); send its
        # chunk only when the client wants the ids or logprobs.
        self.wants_tokens = body.return_token_ids or self.logprobs

    def payload(
        self, c: Chunk | None, text: str, finish: str | None, first: bool = False
    ) -> dict[str, Any]:
        frontend = self.answer.a.frontend
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        with_logprobs = c is not None and self.logprobs and bool(c.logprobs)
        if self.answer.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            if c is not None:
                _delta_channels(delta, c)
            choice["delta"] = delta
            if c is not None and with_logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(frontend, c)}
        else:
            choice["text"] = text
            if c is not None and with_logprobs:
                choice["logprobs"] = _completion_logprobs(frontend, [c])
        if c is not None and self.answer.body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return {**self.base, "choices": [choice]}

    def first(self) -> bytes:
        return sse_event(self.payload(None, "", None, first=True)) if self.answer.chat else b""

    def render(self, c: Chunk) -> bytes:
        if c.finish_reason == "error":  # what text it has, then the error event
            return sse_event(self.payload(c, c.text, None)) if c.text else b""
        if (
            c.text
            or c.finish_reason
            or c.reasoning
            or c.tool_calls
            or (self.wants_tokens and c.token_ids)
        ):
            return sse_event(self.payload(c, c.text, c.finish_reason))
        return b""

    def usage(self) -> bytes:
        usage = dump(_usage(self.answer.a.prepared, self.answer.gen))
        return sse_event({**self.base, "choices": [], "usage": usage})


async def _stream(answer: _Answer) -> web.StreamResponse:
    body, gen, a = answer.body, answer.gen, answer.a
    chunks = _Chunks(answer)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    async with gen:
        out = a.stream(chunks.first())
        await pump(
            answer.request,
            gen,
            out,
            model=body.model,
            deadline=a.deadline,
            render=chunks.render,
            error_event=lambda e: sse_event(e.body()),
        )
        if include_usage and gen.finish_reason != "error":
            await out.write(chunks.usage())
        await out.write(sse_event(DONE))
    return await out.end()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(ChatCompletionRequest, await read_json(request))
    return await _generate(request, body, chat=True)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(CompletionRequest, await read_json(request))
    return await _generate(request, body, chat=False)


def _model_object(slot: ModelSlot) -> Model:
    return Model(
        id=slot.name,
        object="model",
        created=int(slot.created_at),
        owned_by="mlxd",
        aliases=list(slot.entry.aliases),
        state=slot.state,
    )


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    # Every configured model: a stopped one starts on its first request.
    data = [_model_object(s) for s in request.app[MODELS].slots]
    return web.json_response(dump(ModelList(object="list", data=data)))


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    slot = request.app[MODELS].resolve(request.match_info["model"])
    return web.json_response(dump(_model_object(slot)))
