"""One request's state: what the handlers learn about it, for its record (log, metrics, trace).

The request middleware (gateway/http/app.py) creates a `RequestState` for every
request and reads it back when the request ends; auth, the API routes and the
shared driver fill it in through `state(request)`. One typed object instead of
string keys on `web.Request`, so a typo is a type error, not a silent None.

Threading: event loop only (one request's handler and its middleware).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.http.sse import SSEStream
    from gateway.serving.choices import Choices
    from gateway.serving.generation import Generation, Trace


@dataclass(slots=True)
class RequestState:
    request_id: str  # internal: keys the request end to end (gateway, IPC, worker, logs)
    arrival: float  # monotonic
    # The client's X-Request-ID: a label echoed and logged, never a key (any
    # client may send any value, another client's included).
    client_request_id: str | None = None
    # For the request's log line: set once its body was understood.
    model: str | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    # Who asked (an API key's label, never the key) and what refused it.
    api_key: str | None = None
    rejected: str | None = None  # "queue_full", "rate_limited"
    # Its outcome, where the handler knows it better than the HTTP status.
    error: str | None = None
    finish_reason: str | None = None
    # Its stages (gateway/observability/tracing.py).
    trace: Trace | None = None
    admitted_at: float | None = None
    cancelled_at: float | None = None
    generation: Generation | Choices | None = None  # Choices: n > 1, prompt lists
    sse: SSEStream | None = None  # a streaming request's response, once admitted
    # Close the connection after the response (a body cut off mid-way:
    # gateway/http/slow_clients.py).
    close_connection: bool = False


_STATE = web.RequestKey("mlxd_state", RequestState)


def new_request_id() -> str:
    """The internal request id: 128 random bits nobody else can choose or guess.

    It keys the request everywhere (gateway, IPC, worker, logs, traces); a
    client's X-Request-ID is only a label logged beside it.
    """
    return secrets.token_hex(16)


def begin(request: web.Request, arrival: float, client_request_id: str | None) -> RequestState:
    """The request's state, new, under a new internal id (the request middleware
    calls this first)."""
    st = request[_STATE] = RequestState(new_request_id(), arrival, client_request_id)
    return st


def state(request: web.Request) -> RequestState:
    return request[_STATE]


def state_or_none(request: web.Request) -> RequestState | None:
    """None before the request middleware ran (a response prepared by aiohttp itself)."""
    return request.get(_STATE)
