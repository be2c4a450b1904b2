"""Cheap bounds on a request body's shape, checked before pydantic validates it.

Validation costs CPU per JSON value, on the event loop (pydantic holds the GIL,
so a thread would not free the loop): 200,000 one-word messages took 1.6 s
and stalled every other request (#13 finding 7). These limits make the worst
body a validation of milliseconds; each is far above what a real client sends.

Threading: pure functions; any thread.
"""

from __future__ import annotations

from typing import Any

from gateway.http.errors import APIError

MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300)
MAX_TOOLS = 512


def check_body_shape(data: Any, max_messages: int) -> None:
    """A 400 naming the field when a list or map in the body is over its bound."""
    if not isinstance(data, dict):
        return  # parse_body's own 400
    _bounded(data, "messages", max_messages)
    _bounded(data, "input", max_messages)  # the Responses API's messages
    _bounded(data, "logit_bias", MAX_LOGIT_BIAS)
    _bounded(data, "tools", MAX_TOOLS)


def _bounded(data: dict[str, Any], field: str, limit: int) -> None:
    value = data.get(field)
    if isinstance(value, list | dict) and len(value) > limit:
        raise APIError(
            400,
            f"{field} has {len(value)} entries; this server takes at most {limit}",
            param=field,
        )
