"""Bounds on what a client can put into a log line.

Every user-controlled value that reaches a log (model names, X-Request-ID
labels, paths, user agents, error messages that echo input) goes through
`cap`: a 7 MB model name costs a log line 200 characters, not 14 MB. Prompt
and output text are never logged at all (docs/reliability.md).

Threading: pure functions; any thread.
"""

from __future__ import annotations

from typing import overload

MAX_LOGGED_CHARS = 200


@overload
def cap(value: str, limit: int = MAX_LOGGED_CHARS) -> str: ...
@overload
def cap(value: None, limit: int = MAX_LOGGED_CHARS) -> None: ...
def cap(value: str | None, limit: int = MAX_LOGGED_CHARS) -> str | None:
    """`value`, cut to `limit` characters with a note of how much was cut."""
    if value is None or len(value) <= limit:
        return value
    return f"{value[:limit]}...[{len(value) - limit} more chars]"
