"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Handlers parse and validate the body (gateway/http/bodies.py) into the canonical
request (gateway/serving/requests.py), run it through the shared driver
(gateway/api/driver.py: admission, preparation, deadline, collect or pump), and
render OpenAI's shapes: a JSON answer built from the response models
(gateway/api/openai/schemas.py), or SSE chunks (`data: {...}` ... `data: [DONE]`).
Every answer has one choice per prompt and sample (n > 1, prompt lists:
gateway/serving/choices.py), each with its logprobs (gateway/serving/logprobs.py).
The model list answers in Anthropic's shape to Anthropic clients
(gateway/api/anthropic/models.py).

Threading: event loop only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.api.anthropic import models as anthropic_models
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
from gateway.serving.choices import Choices
from gateway.serving.generation import Chunk, Generation
from gateway.serving.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest
from gateway.workers.registry import HostedModel

routes = web.RouteTableDef()


def _usage(gen: Choices) -> Usage:
    # n choices: each distinct prompt counted once, completion tokens summed.
    n = gen.prompt_tokens()
    return Usage(
        prompt_tokens=n,
        completion_tokens=gen.completion_tokens,
        total_tokens=n + gen.completion_tokens,
        prompt_tokens_details={"cached_tokens": gen.cached_tokens},
    )


# -- reasoning and tool calls (gateway/serving/reasoning.py) ---------------------


def _message(chunks: list[Chunk]) -> AssistantMessage:
    """A chat answer's message: content, and its reasoning_content and tool_calls."""
    # refusal: required by the spec, null since mlxd never refuses this way.
    text = "".join(c.text for c in chunks)
    message = AssistantMessage(role="assistant", content=text, refusal=None)
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
    gen: Choices
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
            answer = _Answer(request, body, chat, a, a.all_choices(request), int(time.time()))
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
    common: dict[str, Any] = {
        "id": answer.id,
        "created": answer.created,
        "model": body.model,
        "system_fingerprint": answer.fingerprint,
        "usage": _usage(gen),
    }
    if body.return_token_ids:
        common["prompt_token_ids"] = a.prepared.prompt
    mine = [[c for c in chunks if c.index == k] for k in range(len(gen.gens))]
    payload: ChatCompletion | Completion
    if answer.chat:
        chats = [_chat_choice(answer, g, mine[k], k) for k, g in enumerate(gen.gens)]
        payload = ChatCompletion(object="chat.completion", choices=chats, **common)
    else:
        texts = [_completion_choice(answer, g, mine[k], k) for k, g in enumerate(gen.gens)]
        payload = Completion(object="text_completion", choices=texts, **common)
    gen.trace.first_byte = time.monotonic()
    return await finish_bounded(answer.request, web.json_response(dump(payload)))


def _choice_fields(
    answer: _Answer, gen: Generation, chunks: list[Chunk], index: int
) -> dict[str, Any]:
    """What a chat and a completion choice share."""
    choice: dict[str, Any] = {"index": index, "finish_reason": gen.finish_reason, "logprobs": None}
    if answer.body.return_token_ids:
        choice["token_ids"] = [t for c in chunks for t in c.token_ids]
    return choice


def _chat_choice(answer: _Answer, gen: Generation, chunks: list[Chunk], index: int) -> ChatChoice:
    choice = _choice_fields(answer, gen, chunks, index)
    prepared = gen.prepared
    if prepared.top_logprobs is not None:
        # No reasoning/tool split: the text is every token's.
        text = "".join(c.text for c in chunks) if prepared.output is None else None
        content = chat_logprobs(answer.a.frontend, chunks, text)
        choice["logprobs"] = {"content": content, "refusal": None}
    return ChatChoice(message=_message(chunks), **choice)


def _completion_choice(
    answer: _Answer, gen: Generation, chunks: list[Chunk], index: int
) -> CompletionChoice:
    choice = _choice_fields(answer, gen, chunks, index)
    prepared = gen.prepared
    text = "".join(c.text for c in chunks)
    if prepared.top_logprobs is not None:
        offsets = TextOffsets(len(prepared.prompt_text))
        choice["logprobs"] = completion_logprobs(answer.a.frontend, chunks, offsets, text)
    echo = prepared.prompt_text if getattr(answer.body, "echo", False) else ""
    return CompletionChoice(text=echo + text, **choice)


class _Chunks:
    """The SSE chunks of one streamed answer, per choice (index, logprobs offsets, echo)."""

    def __init__(self, answer: _Answer) -> None:
        body = answer.body
        self.answer = answer
        self.base: dict[str, Any] = {
            "id": answer.id,
            "object": "chat.completion.chunk" if answer.chat else "text_completion",
            "created": answer.created,
            "model": body.model,
            "system_fingerprint": answer.fingerprint,
        }
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if self.include_usage:
            # The spec: with include_usage, every chunk but the last carries usage: null.
            self.base["usage"] = None
        self.logprobs = answer.a.prepared.top_logprobs is not None
        self.offsets = [TextOffsets(len(p.prompt_text)) for p in answer.a.choices]
        # A token may add no text yet (held-back space or partial UTF-8); send its
        # chunk only when the client wants the ids or logprobs.
        self.wants_tokens = body.return_token_ids or self.logprobs

    def payload(
        self, c: Chunk | None, text: str, finish: str | None, index: int = 0, first: bool = False
    ) -> dict[str, Any]:
        k = c.index if c is not None else index
        frontend = self.answer.a.frontend
        choice: dict[str, Any] = {"index": k, "finish_reason": finish, "logprobs": None}
        with_logprobs = c is not None and self.logprobs and bool(c.logprobs)
        if self.answer.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            if c is not None:
                _delta_channels(delta, c)
            choice["delta"] = delta
            if c is not None and with_logprobs:
                choice["logprobs"] = {"content": chat_logprobs(frontend, [c]), "refusal": None}
        else:
            choice["text"] = text
            if c is not None and with_logprobs:
                choice["logprobs"] = completion_logprobs(frontend, [c], self.offsets[k])
        if c is not None and self.answer.body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return {**self.base, "choices": [choice]}

    def first(self) -> bytes:
        """What goes before the first token: chat's role chunks, completions' echo."""
        choices = self.answer.a.choices
        if self.answer.chat:
            n = len(choices)
            return b"".join(
                sse_event(self.payload(None, "", None, index=k, first=True)) for k in range(n)
            )
        if getattr(self.answer.body, "echo", False):
            return b"".join(
                sse_event(self.payload(None, p.prompt_text, None, index=k))
                for k, p in enumerate(choices)
            )
        return b""

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
        usage = dump(_usage(self.answer.gen))
        return sse_event({**self.base, "choices": [], "usage": usage})


async def _stream(answer: _Answer) -> web.StreamResponse:
    body, gen, a = answer.body, answer.gen, answer.a
    chunks = _Chunks(answer)
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
        if chunks.include_usage and gen.finish_reason != "error":
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


def _model_object(hosted: HostedModel) -> Model:
    return Model(
        id=hosted.name,
        object="model",
        created=int(hosted.created_at),
        owned_by="mlxd",
        aliases=list(hosted.entry.aliases),
        state=hosted.state,
    )


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    # Every configured model: a stopped one starts on its first request.
    hosted_models = list(request.app[MODELS].hosted_models)
    if anthropic_models.HEADER in request.headers:  # the Anthropic SDK's models.list()
        return web.json_response(anthropic_models.model_list(hosted_models))
    data = [_model_object(s) for s in hosted_models]
    return web.json_response(dump(ModelList(object="list", data=data)))


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    hosted = request.app[MODELS].resolve(request.match_info["model"])
    if anthropic_models.HEADER in request.headers:
        return web.json_response(anthropic_models.model_info(hosted))
    return web.json_response(dump(_model_object(hosted)))
