"""The OpenAI API's response bodies, as pydantic models.

The handlers (gateway/api/openai/routes.py) build their JSON answers from these
classes, and gateway/http/openapi.py describes the responses from the same
classes, so the description cannot drift from what is served. Request bodies are
the canonical request models (gateway/serving/requests.py), which every API
converts into. Fields that are sometimes absent default to None and are left out
of the JSON when not set (`dump`).

Threading: pure data, any thread.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


def dump(model: BaseModel) -> dict[str, Any]:
    """The JSON object of a response model: the fields it was given, None included."""
    return model.model_dump(exclude_unset=True)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = Field(None, description="always null: mlxd does not refuse this way")
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None
    token_ids: list[int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    aliases: list[str] = Field(default_factory=list)
    state: str = Field("stopped", description="`stopped` until its first request")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]
