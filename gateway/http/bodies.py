"""Request bodies: JSON that is well-formed text, then a pydantic model, or a 4xx APIError.

Every API route reads its body through `read_json` and `parse_body`, so a bad body
is the same OpenAI-style 400 (413, 415) wherever it arrives. Before the event loop
parses or validates anything costly, a large body is prechecked in a helper process
(gateway/serving/json_precheck.py) and list sizes are bounded
(gateway/serving/body_shape.py).

Threading: event loop only; `parse_body` is pure.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from gateway.http.app_keys import JSON_PRECHECK, SETTINGS
from gateway.http.errors import APIError
from gateway.serving.body_shape import check_body_shape

M = TypeVar("M", bound=BaseModel)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json(request: web.Request) -> Any:
    ctype = request.content_type
    if request.body_exists and ctype not in ("application/json", "", "application/octet-stream"):
        raise APIError(415, f"expected an application/json body, got {ctype!r}")
    raw = await request.read()  # raises 413 past client_max_size
    if not raw:
        raise APIError(400, "the request body is empty; expected a JSON object")
    settings = request.app[SETTINGS]
    # A large body is parsed (and refused if it must be) off the loop first.
    await request.app[JSON_PRECHECK].check(raw)
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
    # Before validation, whose cost grows with the number of values (body_shape).
    check_body_shape(data, settings.max_messages)
    return data


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
