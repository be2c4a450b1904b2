"""The OpenAPI description is true: same routes as the app, same scopes as auth, current docs.

If a test here fails after you added or changed a route or a request field:
describe it in gateway/http/openapi.py, then run `make openapi` to rewrite
docs/openapi.yaml.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import load_settings
from gateway.http.app import create_app
from gateway.http.auth import required_scope
from gateway.http.openapi import DOC_PATH, TEST_ONLY, build_spec, operations
from tests.helpers import Server


def _registered(test_faults: bool) -> set[tuple[str, str]]:
    """(path, method) of every route the app registers (HEAD comes with GET)."""
    # Workers (and their socket directories) are made when the app starts, not here.
    app = create_app(load_settings(test_faults=test_faults))
    return {
        (route.resource.canonical, route.method.lower())
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }


@pytest.mark.parametrize("test_faults", [False, True])
def test_spec_describes_exactly_the_registered_routes(test_faults: bool) -> None:
    spec_ops = operations(build_spec(test_faults=test_faults))
    registered = _registered(test_faults)
    assert spec_ops - registered == set(), "described but not served"
    assert registered - spec_ops == set(), "served but not described in gateway/http/openapi.py"
    assert (spec_ops >= TEST_ONLY) == test_faults


def test_security_matches_the_enforced_scopes() -> None:
    for path, item in build_spec()["paths"].items():
        concrete = path.replace("{model}", "some-model")
        for method, op in item.items():
            expected = required_scope(concrete)
            # A key in either header (Authorization: Bearer, x-api-key), with the scope.
            alternatives = [{"bearer": [expected]}, {"apiKey": [expected]}]
            assert op["security"] == ([] if expected is None else alternatives), (method, path)
            statuses = set(op["responses"])
            assert ({"401", "403"} <= statuses) == (expected is not None), (method, path)


def test_every_error_response_is_the_openai_error_object() -> None:
    spec = build_spec()
    for path, item in spec["paths"].items():
        for method, op in item.items():
            for status, resp in op["responses"].items():
                if int(status) >= 400 and path not in ("/ready", "/health", "/startup"):
                    if path == "/models/{model}/ready" and status == "503":
                        continue  # a probe's 503 is its readiness body
                    schema = resp["content"]["application/json"]["schema"]
                    # Anthropic's route answers in Anthropic's shape (its clients expect it).
                    name = "AnthropicError" if path.startswith("/v1/messages") else "Error"
                    assert schema == {"$ref": f"#/components/schemas/{name}"}, (method, path)


def test_spec_is_valid_openapi_3_1() -> None:
    schemathesis = pytest.importorskip("schemathesis")
    spec = build_spec()
    assert spec["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(json.loads(json.dumps(spec))).validate()


def test_docs_openapi_yaml_is_current() -> None:
    documented = yaml.safe_load(Path(DOC_PATH).read_text())
    assert documented == json.loads(json.dumps(build_spec())), (
        "docs/openapi.yaml is stale: run `make openapi`"
    )


def test_served_openapi_json(server: Server) -> None:
    r = httpx.get(server.url + "/openapi.json", timeout=10)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.json() == json.loads(json.dumps(build_spec(test_faults=False)))
