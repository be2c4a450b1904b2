"""The OpenAPI 3.1 description of every HTTP route: GET /openapi.json, docs/openapi.yaml.

The description is built here, from code: request bodies are the JSON schemas
of the pydantic models that validate them (gateway/serving/requests.py), so they cannot
drift from what the server accepts; responses, statuses and scopes are written
out below. `python -m gateway.http.openapi` (`make openapi`) writes
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

from gateway.api.anthropic.routes import CountTokensRequest, MessagesRequest
from gateway.api.openai.responses_schemas import CreateResponseRequest
from gateway.http.app_keys import SETTINGS
from gateway.http.auth import required_scope
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


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF + name}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(status: int, schema: str = "Error") -> dict[str, Any]:
    return _json(_ref(schema), _ERROR_TEXT[status])


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


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_NULLABLE_STR = {"type": ["string", "null"]}
_NULLABLE_NUM = {"type": ["number", "null"]}
_NULLABLE_INT = {"type": ["integer", "null"]}


def _response_schemas() -> dict[str, Any]:
    usage = _obj(
        ["prompt_tokens", "completion_tokens", "total_tokens"],
        prompt_tokens=_INT,
        completion_tokens=_INT,
        total_tokens=_INT,
        prompt_tokens_details={"type": "object"},
    )
    choice_base = {
        "index": _INT,
        "finish_reason": _NULLABLE_STR,
        "logprobs": {"type": ["object", "null"]},
        "token_ids": {"type": "array", "items": _INT},
    }
    completion_base = {
        "id": _STR,
        "created": _INT,
        "model": _STR,
        "system_fingerprint": _STR,
        "usage": _ref("Usage"),
    }
    return {
        "Error": _obj(
            ["error"],
            error={
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": _STR,
                    "type": _STR,
                    "param": _NULLABLE_STR,
                    "code": _NULLABLE_STR,
                },
            },
        ),
        "Usage": usage,
        "ChatCompletion": _obj(
            ["id", "object", "created", "model", "choices", "usage"],
            object={"const": "chat.completion"},
            choices={
                "type": "array",
                "items": _obj(
                    ["index", "message", "finish_reason"],
                    message=_obj(["role"], role={"const": "assistant"}, content=_NULLABLE_STR),
                    **choice_base,
                ),
            },
            prompt_token_ids={"type": "array", "items": _INT},
            **completion_base,
        ),
        "Completion": _obj(
            ["id", "object", "created", "model", "choices", "usage"],
            object={"const": "text_completion"},
            choices={
                "type": "array",
                "items": _obj(["index", "text", "finish_reason"], text=_STR, **choice_base),
            },
            prompt_token_ids={"type": "array", "items": _INT},
            **completion_base,
        ),
        "Model": _obj(
            ["id", "object", "created", "owned_by"],
            id=_STR,
            object={"const": "model"},
            created=_INT,
            owned_by=_STR,
            aliases={"type": "array", "items": _STR},
            state={"type": "string", "description": "`stopped` until its first request"},
        ),
        "ModelList": _obj(
            ["object", "data"],
            object={"const": "list"},
            data={"type": "array", "items": _ref("Model")},
        ),
        "Live": _obj(["status"], status={"const": "ok"}),
        "Startup": _obj(
            ["status"],
            status={"enum": ["started", "starting"]},
            startup_s=_NULLABLE_NUM,
            phase=_STR,
            reason=_NULLABLE_STR,
        ),
        "Readiness": _obj(
            ["status", "model"],
            status={"enum": ["ready", "not_ready"]},
            model=_NULLABLE_STR,
            phase=_STR,
            reason=_STR,
        ),
        "ServedModels": _obj(
            ["object", "data"],
            object={"const": "list"},
            data={
                "type": "array",
                "items": _obj(
                    ["id", "state", "phase", "ready", "reason"],
                    id=_STR,
                    aliases={"type": "array", "items": _STR},
                    pinned=_BOOL,
                    state=_STR,
                    phase=_STR,
                    ready=_BOOL,
                    reason=_STR,
                ),
            },
        ),
        "ModelStatus": _obj(
            ["model", "state", "phase", "ready", "reason", "queue", "worker", "worker_error"],
            model=_STR,
            aliases={"type": "array", "items": _STR},
            pinned=_BOOL,
            state={
                "enum": [
                    "stopped",
                    "starting",
                    "ready",
                    "draining",
                    "restarting",
                    "failed",
                    "stopping",
                ]
            },
            phase=_STR,
            ready=_BOOL,
            reason=_STR,
            startup_s=_NULLABLE_NUM,
            restarts=_INT,
            starts=_INT,
            leases=_INT,
            idle_timeout_s=_NUM,
            idle_s=_NUM,
            footprint_bytes=_INT,
            models_memory=_obj(["budget", "used"], budget=_INT, used=_INT),
            identity=_NULLABLE_STR,
            worker_pid=_NULLABLE_INT,
            epoch=_NULLABLE_INT,
            queue=_obj(
                ["queued", "in_flight", "max_queued", "max_in_flight"],
                queued=_INT,
                in_flight=_INT,
                max_queued=_INT,
                max_in_flight=_INT,
                drain_rate_per_s=_NUM,
                retry_after_s=_INT,
            ),
            in_flight=_INT,
            memory={"type": "object"},
            prefix_cache={"type": "object"},
            worker={
                "type": ["object", "null"],
                "description": "The worker's own stats (requests, batch_rows, governor, ...)",
            },
            worker_error=_NULLABLE_STR,
        ),
        "Version": _obj(
            ["version", "protocol_version", "python"],
            version=_NULLABLE_STR,
            protocol_version=_INT,
            python=_STR,
            mlx=_NULLABLE_STR,
            mlx_lm=_NULLABLE_STR,
            model_identity=_NULLABLE_STR,
            models={"type": "object", "additionalProperties": _NULLABLE_STR},
        ),
        # /v1/messages answers every error in Anthropic's shape, including those
        # raised before its handler runs (auth, routing, body size).
        "AnthropicError": _obj(
            ["type", "error"],
            type={"const": "error"},
            error=_obj(["type", "message"], type=_STR, message=_STR),
        ),
        "AnthropicMessage": _obj(
            ["id", "type", "role", "model", "content", "stop_reason", "usage"],
            id=_STR,
            type={"const": "message"},
            role={"const": "assistant"},
            model=_STR,
            content={"type": "array", "items": _obj(["type"], type=_STR)},
            stop_reason=_NULLABLE_STR,
            stop_sequence=_NULLABLE_STR,
            usage=_obj(["input_tokens", "output_tokens"], input_tokens=_INT, output_tokens=_INT),
        ),
        "TokenCount": _obj(["input_tokens"], input_tokens=_INT),
        "ResponseObject": _obj(
            ["id", "object", "created_at", "status", "model", "output", "usage"],
            id=_STR,
            object={"const": "response"},
            created_at=_INT,
            status={"enum": ["completed", "incomplete", "failed", "in_progress"]},
            model=_STR,
            output={
                "type": "array",
                "items": _obj(
                    ["id", "type"],
                    id=_STR,
                    type={"enum": ["message", "reasoning", "function_call"]},
                ),
            },
            incomplete_details={"type": ["object", "null"]},
            previous_response_id=_NULLABLE_STR,
            usage={
                "type": ["object", "null"],
                "required": ["input_tokens", "output_tokens", "total_tokens"],
                "properties": {
                    "input_tokens": _INT,
                    "output_tokens": _INT,
                    "total_tokens": _INT,
                    "input_tokens_details": {"type": "object"},
                    "output_tokens_details": {"type": "object"},
                },
            },
        ),
        "ResponseDeleted": _obj(
            ["id", "object", "deleted"],
            id=_STR,
            object={"const": "response.deleted"},
            deleted={"const": True},
        ),
        "FaultRequest": _obj(
            ["kind"], kind={"enum": ["wedge", "crash", "corrupt"]}, seconds={"type": "number"}
        ),
        "FaultAccepted": _obj(["status", "kind"], status={"const": "accepted"}, kind=_STR),
    }


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
        responses[str(status)] = _error(status, error_schema)
    return {
        "operationId": op_id,
        "summary": summary,
        "tags": [tag],
        "security": security,
        "responses": responses,
        **extra,
    }


_RESPONSE_ID_PARAM = {
    "name": "response_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "A stored response's id (`resp_...`)",
}

_MODEL_PARAM = {
    "name": "model",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The served model id (GET /v1/models)",
}


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


def _generation(body: dict[str, Any], result: str, what: str) -> dict[str, Any]:
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "ok": {
            "description": f"{what}: JSON, or with `stream: true` server-sent events "
            "(`data: {chunk}` lines ending with `data: [DONE]`; a late error arrives as "
            "`data: {error}`)",
            "content": {
                "application/json": {"schema": _ref(result)},
                "text/event-stream": {"schema": _SSE},
            },
        },
    }


def build_spec(*, test_faults: bool = True) -> dict[str, Any]:
    """The OpenAPI document; `test_faults` adds the test-only fault route."""
    components = _response_schemas()
    chat = _generation(_model_schema(ChatCompletionRequest, components), "ChatCompletion", "chat")
    text = _generation(_model_schema(CompletionRequest, components), "Completion", "completion")
    gen_errors = [400, 404, 413, 415, 429, 500, 503, 504]
    messages = {
        "required": True,
        "content": {"application/json": {"schema": _model_schema(MessagesRequest, components)}},
    }
    count = {
        "required": True,
        "content": {"application/json": {"schema": _model_schema(CountTokensRequest, components)}},
    }
    responses = {
        "required": True,
        "content": {
            "application/json": {"schema": _model_schema(CreateResponseRequest, components)}
        },
    }
    probe = {"503": _json(_ref("Readiness"), "Not ready; `reason` says why")}
    paths: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {
            "post": _op(
                "/v1/chat/completions",
                "createChatCompletion",
                "Chat completion",
                "openai",
                chat["ok"],
                gen_errors,
                requestBody=chat["requestBody"],
            )
        },
        "/v1/completions": {
            "post": _op(
                "/v1/completions",
                "createCompletion",
                "Text completion",
                "openai",
                text["ok"],
                gen_errors,
                requestBody=text["requestBody"],
            )
        },
        "/v1/responses": {
            "post": _op(
                "/v1/responses",
                "createResponse",
                "OpenAI Responses API",
                "openai",
                {
                    "description": "A response: JSON, or with `stream: true` server-sent "
                    "events (`event: response.created` ... `event: response.completed`, "
                    "`response.incomplete` or `response.failed`)",
                    "content": {
                        "application/json": {"schema": _ref("ResponseObject")},
                        "text/event-stream": {"schema": _SSE},
                    },
                },
                gen_errors,
                requestBody=responses,
            )
        },
        "/v1/responses/{response_id}": {
            "get": _op(
                "/v1/responses/{response_id}",
                "getResponse",
                "A stored response (visible to the API key that created it)",
                "openai",
                _json(_ref("ResponseObject"), "The response"),
                [404, 429],
                parameters=[_RESPONSE_ID_PARAM],
            ),
            "delete": _op(
                "/v1/responses/{response_id}",
                "deleteResponse",
                "Delete a stored response",
                "openai",
                _json(_ref("ResponseDeleted"), "Deleted"),
                [404, 429],
                parameters=[_RESPONSE_ID_PARAM],
            ),
        },
        "/v1/messages": {
            "post": _op(
                "/v1/messages",
                "createMessage",
                "Anthropic Messages API (a key may also come as `x-api-key`)",
                "anthropic",
                {
                    "description": "A message: JSON, or with `stream: true` server-sent "
                    "events (`event: message_start` ... `event: message_stop`)",
                    "content": {
                        "application/json": {"schema": _ref("AnthropicMessage")},
                        "text/event-stream": {"schema": _SSE},
                    },
                },
                gen_errors,
                "AnthropicError",
                requestBody=messages,
            )
        },
        "/v1/messages/count_tokens": {
            "post": _op(
                "/v1/messages/count_tokens",
                "countMessageTokens",
                "Prompt tokens of an Anthropic Messages request",
                "anthropic",
                _json(_ref("TokenCount"), "The prompt's token count"),
                [400, 404, 413, 415, 429, 503],
                "AnthropicError",
                requestBody=count,
            )
        },
        "/v1/models": {
            "get": _op(
                "/v1/models",
                "listModels",
                "The served model",
                "openai",
                _json(_ref("ModelList"), "The served model (empty while it first loads)"),
                [429],
            )
        },
        "/v1/models/{model}": {
            "get": _op(
                "/v1/models/{model}",
                "retrieveModel",
                "One model",
                "openai",
                _json(_ref("Model"), "The model"),
                [404, 429],
                parameters=[_MODEL_PARAM],
            )
        },
        "/live": {
            "get": _op(
                "/live", "live", "Liveness", "probes", _json(_ref("Live"), "The loop answers"), []
            )
        },
        "/startup": {
            "get": _op(
                "/startup",
                "startup",
                "Startup probe",
                "probes",
                _json(_ref("Startup"), "The initial model load finished"),
                [],
            )
        },
        "/ready": {
            "get": _op(
                "/ready",
                "ready",
                "Readiness probe",
                "probes",
                _json(_ref("Readiness"), "Requests can be served now"),
                [],
            )
        },
        "/health": {
            "get": _op(
                "/health",
                "health",
                "Readiness probe (compatibility alias of /ready)",
                "probes",
                _json(_ref("Readiness"), "Requests can be served now"),
                [],
            )
        },
        "/models": {
            "get": _op(
                "/models",
                "listServedModels",
                "Served models with state and readiness",
                "admin",
                _json(_ref("ServedModels"), "Served models"),
                [],
            )
        },
        "/models/{model}/ready": {
            "get": _op(
                "/models/{model}/ready",
                "modelReady",
                "Readiness of one model",
                "probes",
                _json(_ref("Readiness"), "The model can serve now"),
                [404],
                parameters=[_MODEL_PARAM],
            )
        },
        "/models/{model}/status": {
            "get": _op(
                "/models/{model}/status",
                "modelStatus",
                "Lifecycle, identity, queue, memory and worker stats of one model",
                "admin",
                _json(_ref("ModelStatus"), "The model's status"),
                [404],
                parameters=[_MODEL_PARAM],
            )
        },
        "/version": {
            "get": _op(
                "/version",
                "version",
                "Versions of mlxd, its protocol, Python, MLX and mlx-lm",
                "admin",
                _json(_ref("Version"), "Versions"),
                [],
            )
        },
        "/metrics": {
            "get": _op(
                "/metrics",
                "metrics",
                "Prometheus metrics",
                "admin",
                {
                    "description": "Prometheus text format 0.0.4",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                [],
            )
        },
        "/openapi.json": {
            "get": _op(
                "/openapi.json",
                "openapi",
                "This OpenAPI description",
                "meta",
                _json({"type": "object"}, "OpenAPI 3.1 document"),
                [],
            )
        },
    }
    # An unknown, expired or other key's response id.
    for path, method, code in (
        ("/v1/responses", "post", "previous_response_not_found"),
        ("/v1/responses/{response_id}", "get", "response_not_found"),
        ("/v1/responses/{response_id}", "delete", "response_not_found"),
    ):
        paths[path][method]["responses"]["404"] = _json(
            _ref("Error"), f"No such stored response for this API key (`{code}`), or model"
        )
    for path in ("/ready", "/health", "/models/{model}/ready"):
        paths[path]["get"]["responses"].update(probe)
    paths["/startup"]["get"]["responses"]["503"] = _json(
        _ref("Startup"), "Still starting, or failed (`phase`)"
    )
    if test_faults:
        paths["/models/{model}/fault"] = {
            "post": _op(
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
        }
        op = paths["/models/{model}/fault"]["post"]
        op["x-mlxd-test-only"] = True
        del op["responses"]["200"]
        op["responses"] = {
            "202": _json(_ref("FaultAccepted"), "The fault is on its way to the worker"),
            **op["responses"],
        }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "mlxd",
            "version": "1",
            "description": (
                "Local LLM inference on MLX: an OpenAI-compatible API, probes, model "
                "status and metrics (docs/api.md). With API keys configured, routes "
                "whose `security` lists a scope need `Authorization: Bearer <key>` with "
                "that scope; without keys every route is open. Every error is an "
                "OpenAI error object, except on /v1/messages (Anthropic's shape)."
            ),
        },
        "servers": [{"url": "/"}],
        "tags": [
            {"name": "openai", "description": "OpenAI-compatible API (scope `inference`)"},
            {"name": "anthropic", "description": "Anthropic Messages API (scope `inference`)"},
            {"name": "probes", "description": "Health probes (open)"},
            {"name": "admin", "description": "Operations (scope `admin`)"},
            {"name": "meta", "description": "This description (open)"},
        ],
        "paths": paths,
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key; its scopes (`inference`, `admin`) are "
                    "listed per operation",
                },
                "apiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "x-api-key",
                    "description": "The same API key in Anthropic's header",
                },
            },
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
