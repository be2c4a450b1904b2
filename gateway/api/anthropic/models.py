"""Anthropic's shape of the model list: `/v1/models` for clients that send `anthropic-version`.

The Anthropic SDK's `models.list()` / `models.retrieve()` call the same paths as
the OpenAI SDK; the `anthropic-version` header (which every Anthropic client
sends) tells them apart, and gateway/api/openai/routes.py's handlers answer with
these shapes when it is present. mlxd lists every configured model on one page,
so `has_more` is always false.

Threading: event loop only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.workers.registry import HostedModel

HEADER = "anthropic-version"


def model_info(hosted: HostedModel) -> dict[str, Any]:
    created = datetime.fromtimestamp(hosted.created_at, tz=UTC)
    return {
        "type": "model",
        "id": hosted.name,
        "display_name": hosted.name,
        "created_at": created.isoformat().replace("+00:00", "Z"),
    }


def model_list(hosted_models: list[HostedModel]) -> dict[str, Any]:
    data = [model_info(s) for s in hosted_models]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
