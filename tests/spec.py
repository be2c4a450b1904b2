"""Validation of response bodies against OpenAI's official OpenAPI description.

Owns loading tests/data/openai-openapi.yaml.gz (once per process: the YAML is
~45k lines) and checking a JSON value against one of its `components.schemas`
with `jsonschema`, `$ref`s resolved within the spec. The spec is OpenAPI 3.1
(JSON Schema 2020-12), but some schemas still carry OpenAPI 3.0's
`nullable: true`; it is rewritten to "or null" on load so that the validator,
which does not know the keyword, does not silently ignore it.

Usage from a test:

    from tests.spec import assert_valid
    assert_valid(body, "CreateChatCompletionResponse")

Thread-safe after the first call (the loaded spec is read-only).
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).resolve().parent / "data" / "openai-openapi.yaml.gz"
_BASE_URI = "urn:openai-openapi"


def _with_null(node: Any) -> Any:
    """Rewrites every `nullable: true` schema into `anyOf: [schema, null]`, recursively."""
    if isinstance(node, list):
        return [_with_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _with_null(value) for key, value in node.items()}
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    out.pop("nullable", None)
    return out


@functools.lru_cache(maxsize=1)
def spec() -> dict[str, Any]:
    """The whole spec as a dict, `nullable` already rewritten."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with gzip.open(SPEC_PATH, "rt", encoding="utf-8") as f:
        raw = yaml.load(f, Loader=loader)  # a safe loader (CSafeLoader or SafeLoader)
    return _with_null(raw)


@functools.lru_cache(maxsize=1)
def _registry() -> Registry:
    resource = Resource.from_contents(spec(), default_specification=DRAFT202012)
    return Registry().with_resource(_BASE_URI, resource)


@functools.cache
def validator(schema_name: str) -> jsonschema.protocols.Validator:
    """A Draft 2020-12 validator for `components.schemas[schema_name]`."""
    if schema_name not in spec()["components"]["schemas"]:
        raise KeyError(f"no component schema {schema_name!r} in the OpenAI spec")
    ref = {"$ref": f"{_BASE_URI}#/components/schemas/{schema_name}"}
    return jsonschema.Draft202012Validator(ref, registry=_registry())


def errors(instance: Any, schema_name: str) -> list[str]:
    """Every violation of `schema_name` by `instance`, one readable line each."""
    found = validator(schema_name).iter_errors(instance)
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message[:300]}"
        for e in sorted(found, key=lambda e: list(map(str, e.absolute_path)))
    ]


def assert_valid(instance: Any, schema_name: str) -> None:
    """Fails the test with every violation listed when `instance` breaks the schema."""
    problems = errors(instance, schema_name)
    assert not problems, f"not a valid {schema_name}:\n" + "\n".join(problems)
