"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes the equivalent chat request (gateway/api/openai/responses_schemas.py)
and runs the chat path: admission, preparation (template, tokens, limits, tool and
structured-output grammars, the reasoning split), Generation, the collectors and the
SSE pump of the shared driver (gateway/api/driver.py). Only the rendering is this
module's (the items and events themselves: gateway/api/openai/responses_output.py):

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
import time
from typing import Any

from aiohttp import web

from gateway.api.driver import Admitted, admitted, collect, early_failure, pump
from gateway.api.openai.responses_output import OutputBuilder, new_id
from gateway.api.openai.responses_schemas import (
    CreateResponseRequest,
    ResponseDeleted,
    ResponseObject,
    ResponsesInputItem,
    ResponsesToolChoiceAllowed,
    ResponsesToolChoiceFunction,
)
from gateway.api.openai.responses_store import RESPONSE_STORE
from gateway.api.openai.responses_translate import to_chat
from gateway.api.openai.schemas import dump
from gateway.http.bodies import parse_body, read_json
from gateway.http.errors import APIError
from gateway.http.request_state import state as request_state
from gateway.http.slow_reader import SlowReader, cut_off, finish_bounded, mark_slow_reader
from gateway.http.sse import sse_event
from gateway.serving.generation import Chunk, Generation
from gateway.serving.requests import ChatCompletionRequest

routes = web.RouteTableDef()


def _event_bytes(event: dict[str, Any]) -> bytes:
    return sse_event(event, event=event["type"])


def _checked(obj: dict[str, Any]) -> dict[str, Any]:
    """A response object, validated by the class that describes it (the OpenAPI's)."""
    return dump(ResponseObject.model_validate(obj))


class ResponseState:
    """One request's response object: the fields it echoes, its id, the conversation."""

    def __init__(
        self, request: web.Request, body: CreateResponseRequest, context: list[dict[str, Any]]
    ) -> None:
        self.request = request
        self.body = body
        self.id = new_id("resp_")
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
        return _checked(obj)

    def save(self, response: dict[str, Any]) -> None:
        """Keep a finished response (with its conversation) for previous_response_id."""
        if not self.store:
            return
        new_input = [i.model_dump(exclude_none=True) for i in self.body.input_items()]
        conversation = self.context + new_input + response["output"]
        owner = request_state(self.request).api_key
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
            body.previous_response_id, request_state(request).api_key
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
                return await _stream(request, state, gen, a)
            return await _complete(request, state, gen, a)
    except APIError as e:
        e.param = _param(e.param)
        resp = await early_failure(request, e, _error_event(e))
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
    entry = request.app[RESPONSE_STORE].get(rid, request_state(request).api_key)
    if entry is None:
        raise _not_found(rid, "response_id", "response_not_found")
    return web.Response(body=entry.response, content_type="application/json")


@routes.delete("/v1/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not request.app[RESPONSE_STORE].delete(rid, request_state(request).api_key):
        raise _not_found(rid, "response_id", "response_not_found")
    deleted = ResponseDeleted(id=rid, object="response.deleted", deleted=True)
    return web.json_response(dump(deleted))


async def _complete(
    request: web.Request, state: ResponseState, gen: Generation, a: Admitted
) -> web.StreamResponse:
    chunks = await collect(request, gen, model=state.body.model, deadline=a.deadline)
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
    request: web.Request, state: ResponseState, gen: Generation, a: Admitted
) -> web.StreamResponse:
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
            writer = a.stream(first)
            ended = await pump(
                request,
                gen,
                writer,
                model=state.body.model,
                deadline=a.deadline,
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
        return await writer.end()
    except SlowReader as e:  # the Generation context has aborted it in the worker
        gen.finish_reason = e.finish_reason
        mark_slow_reader(request, e)
        error = APIError(408, str(e), code="slow_reader")
        await cut_off(request, e.response, _error_event(error, out.seq))
        return e.response
