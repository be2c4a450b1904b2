"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Handlers parse and validate the body, prepare the request (gateway/serving/generation),
then either stream SSE chunks (`data: {...}` ... `data: [DONE]`) or collect the
whole answer. Client disconnects cancel the handler (aiohttp's
handler_cancellation), and the Generation context aborts the request in the
worker on the way out.

Around each generation: admission (gateway/serving/admission) takes a queue position
before tokenization (503 when full) and an in-flight slot after it; one
deadline (`request_timeout_s` from arrival) bounds the wait and the generation
and ends in a clean 504 (or an SSE error event once streaming); streams get SSE
keep-alive comments while no token arrives. Stage timestamps go on the request
for the request record (gateway/observability/tracing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from gateway.api.anthropic import models as anthropic_models
from gateway.http.app_keys import METRICS, MODELS, SETTINGS
from gateway.http.errors import APIError
from gateway.http.slow_reader import (
    SlowReader,
    cut_off,
    finish_bounded,
    mark_slow_reader,
    slow_reader_event,
    slow_reader_timeout_s,
    write_bounded,
    write_eof_bounded,
)
from gateway.serving.choices import Choices, prepare_choices
from gateway.serving.generation import Chunk, Generation, Prepared, Trace
from gateway.serving.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest
from gateway.serving.tokenizer import Frontend
from gateway.workers.client import WorkerClient
from gateway.workers.registry import ModelSlot
from gateway.workers.served_model import ServedModel

routes = web.RouteTableDef()
M = TypeVar("M", bound=BaseModel)


async def read_json(request: web.Request) -> Any:
    ctype = request.content_type
    if request.body_exists and ctype not in ("application/json", "", "application/octet-stream"):
        raise APIError(415, f"expected an application/json body, got {ctype!r}")
    raw = await request.read()  # raises 413 past client_max_size
    if not raw:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    # JSON may escape a lone UTF-16 surrogate ("\ud800"), which is no Unicode
    # text: tokenizers and the worker protocol would fail on it later.
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise APIError(400, "the request body contains a lone UTF-16 surrogate (\\ud800-\\udfff)")
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(data: Any) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    return False


def parse_body(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None


def _with_profile(
    body: ChatCompletionRequest | CompletionRequest, slot: ModelSlot
) -> ChatCompletionRequest | CompletionRequest:
    """The request with the model's default sampling in the fields it left out."""
    defaults = slot.sampling_defaults()
    if not defaults:
        return body
    given = body.model_fields_set
    if "max_completion_tokens" in given:
        given = given | {"max_tokens"}
    update = {k: v for k, v in defaults.items() if k not in given and k in type(body).model_fields}
    return body.model_copy(update=update) if update else body


async def _client(served: ServedModel, deadline: float) -> WorkerClient:
    """The live worker client; through a worker restart, wait for it until the deadline."""
    return await served.acquire_client(_remaining(deadline))


def _usage(prepared: Prepared, gen: Generation | Choices) -> dict[str, Any]:
    # n choices: each distinct prompt counted once, completion tokens summed.
    n = gen.prompt_tokens() if isinstance(gen, Choices) else len(prepared.prompt)
    return {
        "prompt_tokens": n,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": n + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# -- reasoning and tool calls (gateway/serving/reasoning.py) --------------------------------


def _message_channels(message: dict[str, Any], chunks: list[Chunk]) -> None:
    """Add a chat answer's reasoning_content and tool_calls to its message."""
    reasoning = "".join(c.reasoning for c in chunks)
    calls = [{k: v for k, v in t.items() if k != "index"} for c in chunks for t in c.tool_calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None


def _delta_channels(delta: dict[str, Any], c: Chunk) -> None:
    if c.reasoning:
        delta["reasoning_content"] = c.reasoning
    if c.tool_calls:
        delta["tool_calls"] = c.tool_calls
        delta["content"] = delta["content"] or None


# -- the shared driver --------------------------------------------------------------


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _timeout_error(request: web.Request) -> APIError:
    limit = request.app[SETTINGS].request_timeout_s
    request["finish_reason"] = "timeout"
    return APIError(504, f"the request did not finish within {limit:g} s", code="timeout")


class _SSEWriter:
    """One stream's writes: headers sent lazily, keep-alive comments, one writer at a time.

    The response is prepared (headers, then the chat role chunk) at the first
    write: the first token, or the first keep-alive when `interval` seconds pass
    without one. Until then nothing has reached the client, so a failure is still
    a plain HTTP error and a worker restart can still replay the request
    (gateway/serving/generation). Long prefills (and queue waits) produce no tokens; the
    keep-alive task then writes an SSE comment line, which SSE parsers (the
    OpenAI SDK included) ignore, so clients and proxies do not time out. A lock
    keeps the keep-alive task's writes from interleaving with the handler's.
    """

    def __init__(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        first: bytes,
        trace: Trace,
        interval: float,
    ) -> None:
        self.request = request
        self.resp = resp
        self.first = first
        self.trace = trace
        self.interval = interval
        self.started = False
        self.last = time.monotonic()
        # Every write is bounded (gateway/http/slow_reader.py); after one timed out,
        # the rest fail at once.
        self.slow_reader_s = slow_reader_timeout_s(request)
        self.cut: SlowReader | None = None
        self._lock = asyncio.Lock()
        self._task = (
            asyncio.get_running_loop().create_task(self._keepalive()) if interval > 0 else None
        )

    async def write(self, data: bytes) -> None:
        async with self._lock:
            if self.cut is not None:
                raise self.cut
            try:
                if not self.started:
                    if not self.resp.prepared:  # keep-alives may have begun it
                        await self.resp.prepare(self.request)
                    if self.first:
                        await write_bounded(self.resp, self.first, self.slow_reader_s)
                    self.trace.first_byte = time.monotonic()
                    self.started = True
                await write_bounded(self.resp, data, self.slow_reader_s, self.request.transport)
            except SlowReader as e:
                self.cut = e
                raise
            self.last = time.monotonic()

    async def _keepalive(self) -> None:
        try:
            while True:
                await asyncio.sleep(max(0.01, self.last + self.interval - time.monotonic()))
                if time.monotonic() - self.last >= self.interval:
                    await self.write(b": keep-alive\n\n")
        except (ConnectionError, RuntimeError, SlowReader):
            return  # the client went away, stopped reading, or the response ended

    def stop(self) -> None:
        # No await: this also runs while the handler is being cancelled.
        if self._task is not None:
            self._task.cancel()


@dataclass(slots=True)
class Admitted:
    """A request that holds an in-flight slot, tokenized, with a live worker client."""

    client: WorkerClient
    frontend: Frontend
    prepared: Prepared
    trace: Trace
    deadline: float
    served: ServedModel
    choices: list[Prepared]  # n > 1 or several prompts: one per choice (serving/choices)

    def generation(self, request: web.Request, prepared: Prepared | None = None) -> Generation:
        gen = Generation(
            self.client,
            self.frontend,
            prepared or self.prepared,
            self.trace,
            source=self.served,
            replay_limit=request.app[SETTINGS].replay_limit,
            replay_timeout_s=max(1.0, _remaining(self.deadline)),
        )
        request["generation"] = gen
        return gen

    def all_choices(self, request: web.Request) -> Choices:
        """Every choice's generation, driven as one (they share the Trace)."""
        # Prime requests share a prompt's prefill among its n rows (serving/choices);
        # only with a prefix cache to keep the state, and within the deadline.
        cache = request.app[SETTINGS].prefix_cache_bytes > 0
        prime_s = _remaining(self.deadline) if cache and len(self.choices) > 1 else 0.0
        gens = Choices([self.generation(request, p) for p in self.choices], prime_s)
        request["generation"] = gens
        return gens


@contextlib.asynccontextmanager
async def admitted(
    request: web.Request,
    model: str,
    stream: bool,
    body: ChatCompletionRequest | CompletionRequest,
) -> AsyncIterator[Admitted]:
    """Admission and preparation, shared by every generating route (OpenAI, Anthropic).

    The model is resolved (404), a queue position is taken before anything else
    (503 when full), the model is leased (started first if it was stopped: a
    streaming request gets keep-alive comments meanwhile), the request is
    prepared, then it waits for an in-flight slot; one deadline bounds it all.
    The slot and the lease are held until the block exits.
    """
    settings = request.app[SETTINGS]
    registry = request.app[MODELS]
    trace = Trace(arrival=request.get("arrival", time.monotonic()))
    request["trace"] = trace
    request["log"].update(model=model, stream=stream)
    slot = registry.resolve(model)
    deadline = trace.arrival + settings.request_timeout_s
    try:
        # Before tokenization (and before a stopped model starts): a full queue
        # costs the server nothing more.
        ticket = slot.admission.enter()
    except APIError:
        request["rejected"] = "queue_full"
        raise
    cold = stream and (slot.served is None or not slot.served.ready.is_set())
    early = _EarlyKeepalive(request, settings.sse_keepalive_s) if cold else None
    try:
        async with registry.lease(slot, deadline) as served:
            try:
                client = await _client(served, deadline)
            finally:
                if early is not None:
                    await early.stop()
            frontend = served.frontend
            assert frontend is not None
            choices = await prepare_choices(
                _with_profile(body, slot),
                frontend,
                settings,
                client.ready.context_length,
                request["request_id"],
                vocab_size=getattr(client.ready, "vocab_size", 0),
            )
            prepared = choices[0]
            trace.tokenized = time.monotonic()
            request["log"].update(
                prompt_tokens=len(prepared.prompt), max_tokens=prepared.max_tokens
            )
            try:
                async with asyncio.timeout(_remaining(deadline)):
                    await ticket.acquire()
            except TimeoutError:
                raise _timeout_error(request) from None
            except asyncio.CancelledError:
                request["cancelled_at"] = time.monotonic()
                raise
            request["admitted_at"] = ticket.admitted_at
            # The worker may have been replaced while this request waited.
            client = await _client(served, deadline)
            yield Admitted(
                client, served.frontend or frontend, prepared, trace, deadline, served, choices
            )
    finally:
        ticket.release()


class _EarlyKeepalive:
    """Keep-alive comments for a streaming request while its model starts.

    Model loads take seconds to minutes; clients and proxies would time out on a
    silent connection. After `interval` seconds the SSE response is prepared
    (request["sse"], which the stream then continues) and a comment is written
    every interval. A failure after that point cannot be an HTTP status any
    more: `early_sse_error` turns it into the API's SSE error event.
    """

    def __init__(self, request: web.Request, interval: float) -> None:
        self.request = request
        self.resp = request["sse"] = sse_response()
        self.interval = interval
        self.task = asyncio.get_running_loop().create_task(self._run()) if interval > 0 else None

    async def _run(self) -> None:
        limit = slow_reader_timeout_s(self.request)
        with contextlib.suppress(ConnectionError, RuntimeError, SlowReader):
            while True:
                await asyncio.sleep(self.interval)
                if not self.resp.prepared:
                    await self.resp.prepare(self.request)
                await write_bounded(self.resp, b": keep-alive (model starting)\n\n", limit)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


async def early_sse_error(
    request: web.Request, e: APIError, event: bytes
) -> web.StreamResponse | None:
    """The stream's answer to an error raised after keep-alives already began it
    (None when nothing was sent: the caller raises a plain HTTP error)."""
    resp = request.get("sse")
    if resp is None or not resp.prepared:
        return None
    request["error"] = e.message
    limit = slow_reader_timeout_s(request)
    with contextlib.suppress(ConnectionError, RuntimeError, SlowReader):
        await write_bounded(resp, event, limit)
        await write_eof_bounded(resp, limit)
    return resp


async def _generate(
    request: web.Request, body: ChatCompletionRequest | CompletionRequest, chat: bool
) -> web.StreamResponse:
    try:
        async with admitted(request, body.model, body.stream, body) as a:
            return await _run(request, body, chat, a)
    except APIError as e:
        resp = await early_sse_error(request, e, _sse(e.body()) + _sse("[DONE]"))
        if resp is None:
            raise
        return resp


async def collect(
    request: web.Request, gen: Generation | Choices, *, model: str, deadline: float
) -> list[Chunk]:
    """A non-streaming answer's chunks (OpenAI and Anthropic routes): the whole
    generation within the deadline, started over if it is replayed on a new
    worker; a failed generation is an APIError."""
    chunks: list[Chunk] = []
    metrics = request.app[METRICS]
    clock = metrics.token_clock(model)
    async with gen:
        try:
            async with asyncio.timeout(_remaining(deadline)):
                async for c in gen.chunks():
                    if c.reset:  # replayed on a new worker: that choice starts over
                        chunks[:] = [x for x in chunks if x.index != c.index]
                        clock = metrics.token_clock(model)
                        continue
                    chunks.append(c)
                    clock.tick(len(c.token_ids), time.monotonic())
        except TimeoutError:
            gen.finish_reason = "timeout"  # set before leaving: __aexit__ keeps it
            raise _timeout_error(request) from None
        except asyncio.CancelledError:
            request["cancelled_at"] = time.monotonic()
            raise
    if gen.finish_reason == "error":
        raise _generation_failed(gen.error)
    return chunks


def _generation_failed(error: str) -> APIError:
    # A lost worker is the server's availability (503); anything else is a 500.
    status = 503 if "worker unavailable" in error else 500
    return APIError(status, f"generation failed: {error}", code="generation_failed")


async def pump(
    request: web.Request,
    gen: Generation | Choices,
    out: _SSEWriter,
    *,
    model: str,
    deadline: float,
    render: Callable[[Chunk], bytes],
    error_event: Callable[[APIError], bytes],
) -> bool:
    """Write a stream's chunks (OpenAI and Anthropic routes), each as `render`
    makes it, until the generation ends. A failure before any byte left is a
    plain HTTP error (raised); after, it is the API's `error_event`, and the
    result is False. True when the generation ended on its own."""
    metrics = request.app[METRICS]
    clock = metrics.token_clock(model)
    try:
        async with asyncio.timeout(_remaining(deadline)):
            async for c in gen.chunks():
                if c.reset:  # replayed before any byte left: nothing to undo
                    clock = metrics.token_clock(model)
                    continue
                clock.tick(len(c.token_ids), time.monotonic())
                data = render(c)
                if data:
                    await out.write(data)
                if c.finish_reason == "error":
                    raise _generation_failed(c.error)
    except APIError as e:
        if not out.started:
            raise  # nothing sent yet: a plain HTTP error
        # Headers are gone already: the error travels as an SSE event.
        request["error"] = e.message
        await out.write(error_event(e))
        return False
    except TimeoutError:
        gen.finish_reason = "timeout"  # set before leaving: __aexit__ keeps it
        timeout = _timeout_error(request)
        if not out.started:
            raise timeout from None
        request["error"] = timeout.message
        await out.write(error_event(timeout))
        return False
    except asyncio.CancelledError:
        request["cancelled_at"] = time.monotonic()
        raise
    finally:
        out.stop()
    return True


async def _run(
    request: web.Request,
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
    a: Admitted,
) -> web.StreamResponse:
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + request["request_id"]
    base = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": body.model,
        "system_fingerprint": "mlxd-" + a.client.ready.identity,
    }
    gen = a.all_choices(request)
    if body.stream:
        try:
            return await _stream(request, body, chat, gen, a, base)
        except SlowReader as e:  # the Generation context has aborted it in the worker
            gen.finish_reason = e.finish_reason
            mark_slow_reader(request, e)
            await cut_off(request, e.response, slow_reader_event(e))
            return e.response

    chunks = await collect(request, gen, model=body.model, deadline=a.deadline)
    choices = [
        _choice(body, chat, a.frontend, g, [c for c in chunks if c.index == k], k)
        for k, g in enumerate(gen.gens)
    ]
    payload: dict[str, Any] = {**base, "choices": choices, "usage": _usage(a.prepared, gen)}
    if body.return_token_ids:
        payload["prompt_token_ids"] = a.prepared.prompt
    a.trace.first_byte = time.monotonic()
    return await finish_bounded(request, web.json_response(payload))


def _choice(
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
    frontend: Frontend,
    gen: Generation,
    chunks: list[Chunk],
    index: int,
) -> dict[str, Any]:
    """One non-streamed choice: its text (or message) and logprobs."""
    prepared = gen.prepared
    text = "".join(c.text for c in chunks)
    choice: dict[str, Any] = {"index": index, "finish_reason": gen.finish_reason, "logprobs": None}
    if chat:
        # refusal: required by the spec, null since mlxd never refuses this way.
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        _message_channels(choice["message"], chunks)
        if prepared.top_logprobs is not None:
            plain = prepared.output is None  # no reasoning/tool split: text is every token's
            content = chat_logprobs(frontend, chunks, text if plain else None)
            choice["logprobs"] = {"content": content, "refusal": None}
    else:
        echo = prepared.prompt_text if getattr(body, "echo", False) else ""
        choice["text"] = echo + text
        if prepared.top_logprobs is not None:
            offsets = TextOffsets(len(prepared.prompt_text))
            choice["logprobs"] = completion_logprobs(frontend, chunks, offsets, text)
    if body.return_token_ids:
        choice["token_ids"] = [t for c in chunks for t in c.token_ids]
    return choice


def sse_response() -> web.StreamResponse:
    """An unprepared Server-Sent Events response (no caching, no proxy buffering)."""
    return web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )


async def _stream(
    request: web.Request,
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
    gen: Choices,
    a: Admitted,
    base: dict[str, Any],
) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    resp = request.get("sse") or sse_response()
    base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if include_usage:
        # The spec: with include_usage, every chunk but the last carries usage: null.
        base["usage"] = None
    payload = _ChunkPayload(body, chat, a, base)
    # A token may add no text yet (held-back space or partial UTF-8); send its
    # chunk only when the client wants the ids or logprobs.
    wants_tokens = body.return_token_ids or a.prepared.top_logprobs is not None

    def render(c: Chunk) -> bytes:
        if c.finish_reason == "error":  # what text it has, then the error event
            return _sse(payload(c, c.text, None)) if c.text else b""
        if (
            c.text
            or c.finish_reason
            or c.reasoning
            or c.tool_calls
            or (wants_tokens and c.token_ids)
        ):
            return _sse(payload(c, c.text, c.finish_reason))
        return b""

    async with gen:
        out = _SSEWriter(request, resp, payload.opening(), gen.trace, settings.sse_keepalive_s)
        await pump(
            request,
            gen,
            out,
            model=body.model,
            deadline=a.deadline,
            render=render,
            error_event=lambda e: _sse(e.body()),
        )
        if include_usage and gen.finish_reason != "error":
            await out.write(_sse({**base, "choices": [], "usage": _usage(a.prepared, gen)}))
        await out.write(_sse("[DONE]"))
    await write_eof_bounded(resp, out.slow_reader_s)
    return resp


class _ChunkPayload:
    """A stream's chunk bodies, per choice (index, logprobs offsets, echo)."""

    def __init__(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        chat: bool,
        a: Admitted,
        base: dict[str, Any],
    ) -> None:
        self.body, self.chat, self.a, self.base = body, chat, a, base
        self.offsets = [TextOffsets(len(p.prompt_text)) for p in a.choices]

    def opening(self) -> bytes:
        """What goes before the first token: chat's role chunks, completions' echo."""
        if self.chat:
            n = len(self.a.choices)
            return b"".join(_sse(self(None, "", None, index=k, first=True)) for k in range(n))
        if getattr(self.body, "echo", False):
            return b"".join(
                _sse(self(None, p.prompt_text, None, index=k)) for k, p in enumerate(self.a.choices)
            )
        return b""

    def __call__(
        self, c: Chunk | None, text: str, finish: str | None, index: int = 0, first: bool = False
    ) -> dict[str, Any]:
        k = c.index if c is not None else index
        frontend = self.a.frontend
        choice: dict[str, Any] = {"index": k, "finish_reason": finish, "logprobs": None}
        with_logprobs = c is not None and bool(c.logprobs)
        with_logprobs = with_logprobs and self.a.prepared.top_logprobs is not None
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            if c is not None:
                _delta_channels(delta, c)
            choice["delta"] = delta
            if with_logprobs and c is not None:
                choice["logprobs"] = {"content": chat_logprobs(frontend, [c]), "refusal": None}
        else:
            choice["text"] = text
            if with_logprobs and c is not None:
                choice["logprobs"] = completion_logprobs(frontend, [c], self.offsets[k])
        if c is not None and self.body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return {**self.base, "choices": [choice]}


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(ChatCompletionRequest, await read_json(request))
    return await _generate(request, body, chat=True)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(CompletionRequest, await read_json(request))
    return await _generate(request, body, chat=False)


def _model_object(slot: ModelSlot) -> dict[str, Any]:
    return {
        "id": slot.name,
        "object": "model",
        "created": int(slot.created_at),
        "owned_by": "mlxd",
        "aliases": list(slot.entry.aliases),
        "state": slot.state,
    }


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    # Every configured model: a stopped one starts on its first request.
    slots = list(request.app[MODELS].slots)
    if anthropic_models.HEADER in request.headers:  # the Anthropic SDK's models.list()
        return web.json_response(anthropic_models.model_list(slots))
    data = [_model_object(s) for s in slots]
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    slot = request.app[MODELS].resolve(request.match_info["model"])
    if anthropic_models.HEADER in request.headers:
        return web.json_response(anthropic_models.model_info(slot))
    return web.json_response(_model_object(slot))
