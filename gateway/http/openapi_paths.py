"""The OpenAPI description's operations: every route, its statuses, scopes and bodies.

gateway/http/openapi.py assembles the document from these. Request bodies are the
JSON schemas of the pydantic models that validate them; responses refer to the
response models' schemas by name (registered by openapi.py).

Threading: pure functions, any thread.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from gateway.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from gateway.api.openai.responses_schemas import CreateResponseRequest
from gateway.http.auth import required_scope
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/"

_ERROR_TEXT = {
    400: "Invalid request (OpenAI error object; `param` names the field)",
    401: "Missing or unknown API key (when keys are configured)",
    403: "The API key lacks this route's scope",
    404: "Unknown route or model (`model_not_found`)",
    405: "Wrong method; `Allow` lists the right ones",
    413: "Body over `max_body_bytes`",
    415: "A body that is not application/json",
    429: "Over the key's rate limit (`rate_limit_exceeded`); see `Retry-After`",
    500: "Generation failed in the worker (`generation_failed`), the request crashed the "
    "worker twice (`request_crashed_worker`), or an internal error",
    503: "Queue full (`queue_full`) or model not ready (`model_not_ready`); see `Retry-After`",
    504: "The request passed `request_timeout_s` (`timeout`)",
}


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


def model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
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


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": description,
    }


_MODEL_PARAM = _path_param("model", "The served model id (GET /v1/models)")
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
    schema = model_schema(model, components)
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


def api_paths(components: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The generating APIs, OpenAI's and Anthropic's: POST routes with a request body."""
    responses_stream = (
        "A response: JSON, or with `stream: true` server-sent events (`event: "
        "response.created` ... `event: response.completed`, `response.incomplete` or "
        "`response.failed`)"
    )
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
        ("/v1/responses", "createResponse", "OpenAI Responses API", "openai",
         _streamed("ResponseObject", responses_stream), CreateResponseRequest, _GEN_ERRORS,
         "Error"),
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
    paths["/v1/responses/{response_id}"] = _stored_response_ops()
    # An unknown, expired or other key's response id.
    for path, method, code in (
        ("/v1/responses", "post", "previous_response_not_found"),
        ("/v1/responses/{response_id}", "get", "response_not_found"),
        ("/v1/responses/{response_id}", "delete", "response_not_found"),
    ):
        paths[path][method]["responses"]["404"] = _json(
            _ref("Error"), f"No such stored response for this API key (`{code}`), or model"
        )
    return paths


_RESPONSE_ID_PARAM = _path_param("response_id", "A stored response's id (`resp_...`)")


def _stored_response_ops() -> dict[str, Any]:
    path, params = "/v1/responses/{response_id}", [_RESPONSE_ID_PARAM]
    return {
        "get": _op(
            path,
            "getResponse",
            "A stored response (visible to the API key that created it)",
            "openai",
            _json(_ref("ResponseObject"), "The response"),
            [404, 429],
            parameters=params,
        ),
        "delete": _op(
            path,
            "deleteResponse",
            "Delete a stored response",
            "openai",
            _json(_ref("ResponseDeleted"), "Deleted"),
            [404, 429],
            parameters=params,
        ),
    }


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


def get_paths() -> dict[str, dict[str, Any]]:
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


def fault_path() -> dict[str, Any]:
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
