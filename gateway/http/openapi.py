"""The OpenAPI 3.1 description of every HTTP route: GET /openapi.json, docs/openapi.yaml.

The description is built here, from code: request bodies are the JSON schemas
of the pydantic models that validate them (gateway/serving/requests.py,
gateway/api/anthropic/schemas.py), and response bodies those of the models the
handlers build their answers from (gateway/api/*/schemas.py, gateway/http/schemas.py,
gateway/http/errors.py), so neither can drift from what the server does; routes,
statuses and scopes are listed below. `python -m gateway.http.openapi` (`make openapi`) writes
docs/openapi.yaml from it. Tests keep all three in step: the paths and methods
here equal the app's registered routes, each operation's security equals the
scope gateway/http/auth.py enforces on it, and docs/openapi.yaml equals this
description (tests/test_openapi.py).

/openapi.json is open (no key): it describes the API, not this deployment
(no model names, keys or limits), and clients read it before they hold a key.

Threading: `build_spec` is pure; the handler runs on the event loop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from gateway.api.anthropic.schemas import (
    AnthropicError,
    AnthropicMessage,
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
)
from gateway.api.openai.schemas import ChatCompletion, Completion, Model, ModelList
from gateway.http.app_keys import SETTINGS
from gateway.http.auth import required_scope
from gateway.http.errors import Error
from gateway.http.schemas import (
    FaultAccepted,
    FaultRequest,
    Live,
    ModelStatus,
    Readiness,
    ServedModels,
    Startup,
    Version,
)
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest

OPENAPI_VERSION = "3.1.0"
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
REF = "#/components/schemas/"
# Routes that exist only when a setting enables them (tests only).
TEST_ONLY = {("/models/{model}/fault", "post")}

_ERROR_TEXT = {
    400: "Invalid request (OpenAI error object; `param` names the field)",
    401: "Missing or unknown API key (when keys are configured)",
    403: "The API key lacks this route's scope",
    404: "Unknown route or model (`model_not_found`)",
    405: "Wrong method; `Allow` lists the right ones",
    413: "Body over `max_body_bytes`",
    415: "A body that is not application/json",
    429: "Over the key's rate limit (`rate_limit_exceeded`); see `Retry-After`",
    500: "Generation failed in the worker (`generation_failed`) or an internal error",
    503: "Queue full (`queue_full`) or model not ready (`model_not_ready`); see `Retry-After`",
    504: "The request passed `request_timeout_s` (`timeout`)",
}
# Every response body the routes answer with, described from the classes that build it.
_RESPONSES: tuple[type[BaseModel], ...] = (
    Error, ChatCompletion, Completion, Model, ModelList, Live, Startup, Readiness, ServedModels,
    ModelStatus, Version, AnthropicError, AnthropicMessage, TokenCount, FaultRequest, FaultAccepted,
)  # fmt: skip


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF + name}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _strip_titles(node: Any, in_properties: bool = False) -> Any:
    """pydantic's schemas without their auto-generated `title`s (a property may be named so)."""
    if isinstance(node, dict):
        return {
            k: _strip_titles(v, k == "properties" and not in_properties)
            for k, v in node.items()
            if in_properties or k != "title"
        }
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF + "{model}")
    for name, sub in schema.pop("$defs", {}).items():
        _register(name, _strip_titles(sub), components)
    return _ref(_register(model.__name__, _strip_titles(schema), components))


def _register(name: str, schema: dict[str, Any], components: dict[str, Any]) -> str:
    if components.get(name, schema) != schema:
        # Two pydantic models of the same name: rename one, or they would share a schema.
        raise ValueError(f"two different schemas are both named {name!r}")
    components[name] = schema
    return name


def _security(path: str) -> list[dict[str, list[str]]]:
    scope = required_scope(path)
    # Either header carries the key (gateway/http/auth.py), on every route.
    return [] if scope is None else [{"bearer": [scope]}, {"apiKey": [scope]}]


def _op(
    path: str,
    op_id: str,
    summary: str,
    tag: str,
    ok: dict[str, Any],
    errors: list[int],
    error_schema: str = "Error",
    **extra: Any,
) -> dict[str, Any]:
    security = _security(path)
    statuses = set(errors)
    if security:
        statuses |= {401, 403}
    responses: dict[str, Any] = {"200": ok}
    for status in sorted(statuses):
        responses[str(status)] = _json(_ref(error_schema), _ERROR_TEXT[status])
    return {
        "operationId": op_id,
        "summary": summary,
        "tags": [tag],
        "security": security,
        "responses": responses,
        **extra,
    }


_MODEL_PARAM = {
    "name": "model",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The served model id (GET /v1/models)",
}
_GEN_ERRORS = [400, 404, 413, 415, 429, 500, 503, 504]

# The stream as text, or (as SSE-aware tools such as schemathesis read it) each
# event: its `data` is a JSON chunk or `[DONE]`, `event` names Anthropic's events.
_SSE: dict[str, Any] = {
    "oneOf": [
        {"type": "string"},
        {
            "type": "object",
            "required": ["data"],
            "properties": {
                "event": {"type": "string"},
                "data": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
        },
    ]
}


def _body(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = _model_schema(model, components)
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _streamed(result: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {
            "application/json": {"schema": _ref(result)},
            "text/event-stream": {"schema": _SSE},
        },
    }


_OPENAI_STREAM = (
    ": JSON, or with `stream: true` server-sent events (`data: {chunk}` lines ending "
    "with `data: [DONE]`; a late error arrives as `data: {error}`)"
)


def _api_paths(components: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The generating APIs, OpenAI's and Anthropic's: POST routes with a request body."""
    anthropic_stream = (
        "A message: JSON, or with `stream: true` server-sent events "
        "(`event: message_start` ... `event: message_stop`)"
    )
    posts = (
        ("/v1/chat/completions", "createChatCompletion", "Chat completion", "openai",
         _streamed("ChatCompletion", "chat" + _OPENAI_STREAM), ChatCompletionRequest,
         _GEN_ERRORS, "Error"),
        ("/v1/completions", "createCompletion", "Text completion", "openai",
         _streamed("Completion", "completion" + _OPENAI_STREAM), CompletionRequest,
         _GEN_ERRORS, "Error"),
        ("/v1/messages", "createMessage",
         "Anthropic Messages API (a key may also come as `x-api-key`)", "anthropic",
         _streamed("AnthropicMessage", anthropic_stream), MessagesRequest, _GEN_ERRORS,
         "AnthropicError"),
        ("/v1/messages/count_tokens", "countMessageTokens",
         "Prompt tokens of an Anthropic Messages request", "anthropic",
         _json(_ref("TokenCount"), "The prompt's token count"), CountTokensRequest,
         [400, 404, 413, 415, 429, 503], "AnthropicError"),
    )  # fmt: skip
    paths: dict[str, dict[str, Any]] = {}
    for path, op_id, summary, tag, ok, body, errors, error_schema in posts:
        request_body = _body(body, components)
        op = _op(path, op_id, summary, tag, ok, errors, error_schema, requestBody=request_body)
        paths[path] = {"post": op}
    return paths


# (path, operationId, summary, tag, response schema, its description, error statuses):
# the GET routes that answer one JSON body.
_GETS: tuple[tuple[str, str, str, str, str, str, list[int]], ...] = (
    ("/v1/models", "listModels", "The served model", "openai", "ModelList",
     "The served model (empty while it first loads)", [429]),
    ("/v1/models/{model}", "retrieveModel", "One model", "openai", "Model", "The model",
     [404, 429]),
    ("/live", "live", "Liveness", "probes", "Live", "The loop answers", []),
    ("/startup", "startup", "Startup probe", "probes", "Startup",
     "The initial model load finished", []),
    ("/ready", "ready", "Readiness probe", "probes", "Readiness", "Requests can be served now",
     []),
    ("/health", "health", "Readiness probe (compatibility alias of /ready)", "probes",
     "Readiness", "Requests can be served now", []),
    ("/models", "listServedModels", "Served models with state and readiness", "admin",
     "ServedModels", "Served models", []),
    ("/models/{model}/ready", "modelReady", "Readiness of one model", "probes", "Readiness",
     "The model can serve now", [404]),
    ("/models/{model}/status", "modelStatus",
     "Lifecycle, identity, queue, memory and worker stats of one model", "admin",
     "ModelStatus", "The model's status", [404]),
    ("/version", "version", "Versions of mlxd, its protocol, Python, MLX and mlx-lm", "admin",
     "Version", "Versions", []),
)  # fmt: skip


def _get_paths() -> dict[str, dict[str, Any]]:
    paths: dict[str, dict[str, Any]] = {}
    for path, op_id, summary, tag, schema, description, errors in _GETS:
        extra: dict[str, Any] = {"parameters": [_MODEL_PARAM]} if "{model}" in path else {}
        ok = _json(_ref(schema), description)
        paths[path] = {"get": _op(path, op_id, summary, tag, ok, errors, **extra)}
    probe = {"503": _json(_ref("Readiness"), "Not ready; `reason` says why")}
    for path in ("/ready", "/health", "/models/{model}/ready"):
        paths[path]["get"]["responses"].update(probe)
    paths["/startup"]["get"]["responses"]["503"] = _json(
        _ref("Startup"), "Still starting, or failed (`phase`)"
    )
    metrics = {
        "description": "Prometheus text format 0.0.4",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    paths["/metrics"] = {
        "get": _op("/metrics", "metrics", "Prometheus metrics", "admin", metrics, [])
    }
    spec_doc = _json({"type": "object"}, "OpenAPI 3.1 document")
    paths["/openapi.json"] = {
        "get": _op("/openapi.json", "openapi", "This OpenAPI description", "meta", spec_doc, [])
    }
    return paths


def _fault_path() -> dict[str, Any]:
    op = _op(
        "/models/{model}/fault",
        "injectFault",
        "Tests only (`test_faults`): inject a fault into the worker",
        "admin",
        {"description": "unused"},
        [400, 404, 503],
        parameters=[_MODEL_PARAM],
        requestBody={
            "required": True,
            "content": {"application/json": {"schema": _ref("FaultRequest")}},
        },
    )
    op["x-mlxd-test-only"] = True
    del op["responses"]["200"]
    op["responses"] = {
        "202": _json(_ref("FaultAccepted"), "The fault is on its way to the worker"),
        **op["responses"],
    }
    return {"post": op}


_INFO = {
    "title": "mlxd",
    "version": "1",
    "description": (
        "Local LLM inference on MLX: an OpenAI-compatible API, probes, model "
        "status and metrics (docs/api.md). With API keys configured, routes "
        "whose `security` lists a scope need `Authorization: Bearer <key>` with "
        "that scope; without keys every route is open. Every error is an "
        "OpenAI error object, except on /v1/messages (Anthropic's shape)."
    ),
}
_TAGS = [
    {"name": "openai", "description": "OpenAI-compatible API (scope `inference`)"},
    {"name": "anthropic", "description": "Anthropic Messages API (scope `inference`)"},
    {"name": "probes", "description": "Health probes (open)"},
    {"name": "admin", "description": "Operations (scope `admin`)"},
    {"name": "meta", "description": "This description (open)"},
]
_SECURITY_SCHEMES = {
    "bearer": {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key; its scopes (`inference`, `admin`) are listed per operation",
    },
    "apiKey": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "The same API key in Anthropic's header",
    },
}


def build_spec(*, test_faults: bool = True) -> dict[str, Any]:
    """The OpenAPI document; `test_faults` adds the test-only fault route."""
    components: dict[str, Any] = {}
    for model in _RESPONSES:
        _model_schema(model, components)
    paths = {**_api_paths(components), **_get_paths()}
    if test_faults:
        paths["/models/{model}/fault"] = _fault_path()
    return {
        "openapi": OPENAPI_VERSION,
        "info": _INFO,
        "servers": [{"url": "/"}],
        "tags": _TAGS,
        "paths": paths,
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": _SECURITY_SCHEMES,
        },
    }


def operations(spec: dict[str, Any]) -> set[tuple[str, str]]:
    """(path, method) of every operation, methods in lower case."""
    return {(path, method) for path, item in spec["paths"].items() for method in item}


async def openapi_handler(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    spec = _cached.get(settings.test_faults)
    if spec is None:
        spec = _cached[settings.test_faults] = build_spec(test_faults=settings.test_faults)
    return web.json_response(spec)


_cached: dict[bool, dict[str, Any]] = {}


def to_yaml(spec: dict[str, Any]) -> str:
    """YAML text of the spec (PyYAML comes with mlx-lm; only this script needs it)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # shared sub-dicts are written out, not as &anchors

    header = "# Generated by `python -m gateway.http.openapi` (make openapi).\n"
    body = yaml.dump(spec, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return header + body


def main(argv: list[str] | None = None) -> int:
    """Write docs/openapi.yaml (or print the JSON with --json)."""
    args = sys.argv[1:] if argv is None else argv
    spec = build_spec()
    if "--json" in args:
        print(json.dumps(spec, indent=2))
        return 0
    DOC_PATH.write_text(to_yaml(spec))
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
