"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes the equivalent chat request (gateway/api/openai/responses_schemas.py)
and runs the chat path: admission, preparation (template, tokens, limits, tool and
structured-output grammars, the reasoning split), Generation, the collectors and the
SSE pump of gateway/api/openai/routes.py. Only the rendering is this module's:

- output items: a `reasoning` item (the text inside the model's thinking block,
  returned in clear as `reasoning_text` content), a `message` item with one
  `output_text` part, and one `function_call` item per tool call, in the order
  the model wrote them;
- `status` `completed`, or `incomplete` (`incomplete_details.reason`
  `max_output_tokens`) when the token cap cut the answer;
- usage in the Responses shape (`input_tokens`, `output_tokens`, their details);
- the stream's events, each `event: <type>` + `data: {..., sequence_number}`:
  `response.created`, `response.in_progress`, then per item
  `response.output_item.added`, `response.content_part.added`, text deltas
  (`response.output_text.delta` / `response.reasoning_text.delta`), their `.done`,
  `response.content_part.done`, `response.output_item.done` (a function call:
  `response.function_call_arguments.delta` / `.done` instead of the part events),
  and last `response.completed` or `response.incomplete` (`response.failed`
  when generation fails after the stream began).

`store` (default true) keeps the response and its conversation in the
ResponseStore (gateway/api/openai/responses_store.py), from which
`previous_response_id` continues it; ids are mlxd's own random ids, never a
client's request id.

Threading: event loop only.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Any

from aiohttp import web

from gateway.api.openai.responses_schemas import (
    CreateResponseRequest,
    ResponsesInputItem,
    ResponsesToolChoiceAllowed,
    ResponsesToolChoiceFunction,
    to_chat,
)
from gateway.api.openai.responses_store import RESPONSE_STORE
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
from gateway.http.app_keys import SETTINGS
from gateway.http.errors import APIError
from gateway.http.slow_reader import (
    SlowReader,
    cut_off,
    finish_bounded,
    mark_slow_reader,
    write_eof_bounded,
)
from gateway.serving.generation import Chunk, Generation
from gateway.serving.reasoning import REASONING
from gateway.serving.requests import ChatCompletionRequest

routes = web.RouteTableDef()

_PART_TYPES = {"reasoning": "reasoning_text", "message": "output_text"}
_DELTA_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _event_bytes(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class OutputBuilder:
    """One response's output items, built from its chunks, and the stream events that
    build them. Streams and complete answers both go through it, so they agree.

    Events carry consecutive `sequence_number`s from `seq`. Events are rendered to
    bytes at once by the stream, but they hold copies of items anyway: an item
    changes after its `added` event (its text, its status).
    """

    def __init__(self, gen: Generation, seq: int = 0) -> None:
        self.gen = gen
        self.items: list[dict[str, Any]] = []
        self.seq = seq
        self._token_ids: list[int] = []
        self._approx_reasoning = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written
        self._text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def feed(self, c: Chunk) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if c.reasoning:
            events += self._write("reasoning", c.reasoning)
        if c.text:
            events += self._write("message", c.text)
        for call in c.tool_calls:
            events += self._call(call)
        self._count(c)
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close the open item (an empty message when nothing was written at all)."""
        events = self._start("message") if not self.items else []
        return events + self._close(incomplete)

    def reasoning_tokens(self) -> int:
        """Tokens generated for the reasoning block, its markers included (usage).

        Counted on the token ids when the model's markers are single tokens (they
        are special tokens in thinking models); otherwise from the chunks, where a
        chunk that carries both reasoning and other output (a reader that fell
        behind) is shared out by characters.
        """
        fmt = self.gen.prepared.output
        if fmt is None or fmt.think is None:
            return 0
        start, end = (self.gen.frontend.marker_ids(m) for m in fmt.think)
        if len(start) != 1 or len(end) != 1:
            return self._approx_reasoning
        count, inside = 0, fmt.initial == REASONING
        for tok in self._token_ids:
            if not inside and tok == start[0]:
                inside = True
            if inside:
                count += 1
                inside = tok != end[0]
        return count

    def _count(self, c: Chunk) -> None:
        self._token_ids += c.token_ids
        other = len(c.text) + sum(len(t["function"]["arguments"]) for t in c.tool_calls)
        n = len(c.token_ids)
        if c.reasoning:
            self._approx_reasoning += round(n * len(c.reasoning) / (len(c.reasoning) + other))
        elif not other and self.gen.splitter is not None and self.gen.splitter.state == REASONING:
            self._approx_reasoning += n  # held back or marker tokens inside the block

    def _start(self, kind: str) -> list[dict[str, Any]]:
        item: dict[str, Any] = {"id": _new_id("rs_" if kind == "reasoning" else "msg_")}
        if kind == "reasoning":
            item.update(type="reasoning", summary=[], content=[], status="in_progress")
        else:
            item.update(type="message", status="in_progress", role="assistant", content=[])
        self.items.append(item)
        self._open, self._text = item, ""
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return [
            self.event(
                "response.output_item.added", output_index=where["output_index"], item=dict(item)
            ),
            self.event(
                "response.content_part.added", **where, content_index=0, part=self._part(kind, "")
            ),
        ]

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": _PART_TYPES[kind], "text": text}
        if kind == "message":
            part.update(annotations=[], logprobs=[])
        return part

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close(False)
            events += self._start(kind)
        assert self._open is not None
        self._text += text
        delta: dict[str, Any] = {
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            delta["logprobs"] = []
        events.append(self.event(_DELTA_EVENTS[kind] + ".delta", **delta))
        return events

    def _close(self, incomplete: bool) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        kind = item["type"]
        part = self._part(kind, self._text)
        item["content"] = [part]
        item["status"] = "incomplete" if incomplete else "completed"
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        done: dict[str, Any] = {"text": self._text}
        if kind == "message":
            done["logprobs"] = []
        return [
            self.event(_DELTA_EVENTS[kind] + ".done", **where, **done),
            self.event("response.content_part.done", **where, part=dict(part)),
            self.event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=copy.deepcopy(item),
            ),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool call arrives whole (gateway/serving/reasoning.py): all its events at once."""
        events = self._close(False)
        fn = call["function"]
        item = {
            "id": _new_id("fc_"),
            "type": "function_call",
            "status": "completed",
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
        }
        self.items.append(item)
        index = len(self.items) - 1
        added = {**item, "status": "in_progress", "arguments": ""}
        where = {"item_id": item["id"], "output_index": index}
        return [
            *events,
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **where, delta=fn["arguments"]),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=fn["name"],
                arguments=fn["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=dict(item)),
        ]


class ResponseState:
    """One request's response object: the fields it echoes, its id, the conversation."""

    def __init__(
        self, request: web.Request, body: CreateResponseRequest, context: list[dict[str, Any]]
    ) -> None:
        self.request = request
        self.body = body
        self.id = _new_id("resp_")
        self.created_at = int(time.time())
        self.context = context  # the stored conversation this request continues
        self.store = body.store is not False

    def _tool_choice(self) -> Any:
        choice = self.body.tool_choice
        if isinstance(choice, ResponsesToolChoiceFunction | ResponsesToolChoiceAllowed):
            return choice.model_dump()
        return choice or "auto"

    def object(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        effort = body.reasoning.effort if body.reasoning else None
        summary = body.reasoning.summary if body.reasoning else None
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        obj = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": copy.deepcopy(output),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": effort, "summary": summary},
            "store": self.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text_format.echo()},
            "tool_choice": self._tool_choice(),
            "tools": [t.model_dump() for t in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "background": False,
            "service_tier": "default",
            "max_tool_calls": body.max_tool_calls,
            "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
        }
        # The spec allows neither as null: absent until known.
        if usage is not None:
            obj["usage"] = usage
        if body.user is not None:
            obj["user"] = body.user
        return obj

    def save(self, response: dict[str, Any]) -> None:
        """Keep a finished response (with its conversation) for previous_response_id."""
        if not self.store:
            return
        new_input = [i.model_dump(exclude_none=True) for i in self.body.input_items()]
        conversation = self.context + new_input + response["output"]
        owner = self.request.get("api_key")
        self.request.app[RESPONSE_STORE].put(self.id, owner, response, conversation)


def _usage(gen: Generation, out: OutputBuilder) -> dict[str, Any]:
    prompt = len(gen.prepared.prompt)
    return {
        "input_tokens": prompt,
        # mlxd's prefix cache keeps every finished prompt; writes are not counted.
        "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": gen.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens()},
        "total_tokens": prompt + gen.completion_tokens,
    }


def _status(gen: Generation) -> str:
    return "incomplete" if gen.finish_reason == "length" else "completed"


def _not_found(response_id: str, param: str | None, code: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code=code)


def _error_event(e: APIError, seq: int = 0) -> bytes:
    """The stream's `error` event (before `response.created` was sent, or a cut-off)."""
    return _event_bytes(
        {
            "type": "error",
            "code": e.code,
            "message": e.message,
            "param": e.param,
            "sequence_number": seq,
        }
    )


# -- handlers -------------------------------------------------------------------------


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    body = parse_body(CreateResponseRequest, await read_json(request))
    context: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = request.app[RESPONSE_STORE].get(
            body.previous_response_id, request.get("api_key")
        )
        if previous is None:
            raise _not_found(
                body.previous_response_id, "previous_response_id", "previous_response_not_found"
            )
        context = previous.items()
    # Stored items were validated when they were created (or are mlxd's own output).
    items = [ResponsesInputItem.model_validate(i) for i in context]
    state = ResponseState(request, body, context)
    try:
        chat = parse_body(ChatCompletionRequest, to_chat(body, items))
        async with admitted(request, body.model, chat.stream, chat) as a:
            gen = a.generation(request)
            if chat.stream:
                return await _stream(request, state, gen, a.deadline)
            return await _complete(request, state, gen, a.deadline)
    except APIError as e:
        e.param = _param(e.param)
        resp = await early_sse_error(request, e, _error_event(e))
        if resp is None:
            raise
        return resp


# The chat request's fields that an error may name, as this API calls them.
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "enable_thinking": "reasoning.effort",
}


def _param(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    if head == "messages":
        return "input"  # chat message indices are not input item indices
    return _PARAMS[head] + dot + rest if head in _PARAMS else param


@routes.get("/v1/responses/{response_id}")
async def get_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    entry = request.app[RESPONSE_STORE].get(rid, request.get("api_key"))
    if entry is None:
        raise _not_found(rid, "response_id", "response_not_found")
    return web.Response(body=entry.response, content_type="application/json")


@routes.delete("/v1/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not request.app[RESPONSE_STORE].delete(rid, request.get("api_key")):
        raise _not_found(rid, "response_id", "response_not_found")
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def _complete(
    request: web.Request, state: ResponseState, gen: Generation, deadline: float
) -> web.StreamResponse:
    chunks = await collect(request, gen, model=state.body.model, deadline=deadline)
    out = OutputBuilder(gen)
    for c in chunks:
        out.feed(c)
    status = _status(gen)
    out.finish(status == "incomplete")
    payload = state.object(status, out.items, _usage(gen, out))
    state.save(payload)
    gen.trace.first_byte = time.monotonic()
    return await finish_bounded(request, web.json_response(payload))


async def _stream(
    request: web.Request, state: ResponseState, gen: Generation, deadline: float
) -> web.StreamResponse:
    resp = request.get("sse") or sse_response()
    out = OutputBuilder(gen)
    first = b"".join(
        _event_bytes(out.event(kind, response=state.object("in_progress", [])))
        for kind in ("response.created", "response.in_progress")
    )

    def render(c: Chunk) -> bytes:
        return b"".join(_event_bytes(e) for e in out.feed(c))

    def failed(e: APIError) -> bytes:
        error = {"code": "server_error", "message": e.message}
        response = state.object("failed", out.items, _usage(gen, out), error)
        return _event_bytes(out.event("response.failed", response=response))

    try:
        async with gen:
            writer = _SSEWriter(
                request, resp, first, gen.trace, request.app[SETTINGS].sse_keepalive_s
            )
            ended = await pump(
                request,
                gen,
                writer,
                model=state.body.model,
                deadline=deadline,
                render=render,
                error_event=failed,
            )
            if ended:
                status = _status(gen)
                events = out.finish(status == "incomplete")
                final = state.object(status, out.items, _usage(gen, out))
                events.append(out.event(f"response.{status}", response=final))
                await writer.write(b"".join(_event_bytes(e) for e in events))
                state.save(final)
        await write_eof_bounded(resp, writer.slow_reader_s)
        return resp
    except SlowReader as e:  # the Generation context has aborted it in the worker
        gen.finish_reason = e.finish_reason
        mark_slow_reader(request, e)
        error = APIError(408, str(e), code="slow_reader")
        await cut_off(request, e.response, _error_event(error, out.seq))
        return e.response
