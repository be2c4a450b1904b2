"""The OpenAPI 3.1 description of every HTTP route: GET /openapi.json, docs/openapi.yaml.

The description is built here, from code: request bodies are the JSON schemas
of the pydantic models that validate them (gateway/serving/requests.py,
gateway/api/anthropic/schemas.py), and response bodies those of the models the
handlers build their answers from (gateway/api/*/schemas.py, gateway/http/schemas.py,
gateway/http/errors.py), so neither can drift from what the server does; routes,
statuses and scopes are listed in gateway/http/openapi_paths.py.
`python -m gateway.http.openapi` (`make openapi`) writes docs/openapi.yaml from it.
Tests keep all three in step: the paths and methods here equal the app's
registered routes, each operation's security equals the scope gateway/http/auth.py
enforces on it, and docs/openapi.yaml equals this description (tests/test_openapi.py).

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
    TokenCount,
)
from gateway.api.openai.responses_schemas import (
    ResponseDeleted,
    ResponseObject,
)
from gateway.api.openai.schemas import ChatCompletion, Completion, Model, ModelList
from gateway.http.app_keys import SETTINGS
from gateway.http.errors import Error
from gateway.http.openapi_paths import api_paths, fault_path, get_paths, model_schema
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

OPENAPI_VERSION = "3.1.0"
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
# Routes that exist only when a setting enables them (tests only).
TEST_ONLY = {("/models/{model}/fault", "post")}

# Every response body the routes answer with, described from the classes that build it.
_RESPONSES: tuple[type[BaseModel], ...] = (
    Error, ChatCompletion, Completion, Model, ModelList, Live, Startup, Readiness, ServedModels,
    ModelStatus, Version, AnthropicError, AnthropicMessage, TokenCount, FaultRequest, FaultAccepted,
    ResponseObject, ResponseDeleted,
)  # fmt: skip


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
        model_schema(model, components)
    paths = {**api_paths(components), **get_paths()}
    if test_faults:
        paths["/models/{model}/fault"] = fault_path()
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
