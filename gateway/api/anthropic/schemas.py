"""Anthropic's Messages API bodies, as pydantic models: requests and responses.

The request models validate /v1/messages and /v1/messages/count_tokens bodies;
the response models are what the handlers (gateway/api/anthropic/routes.py) build
their JSON answers from. gateway/http/openapi.py describes both from these same
classes. Fields that are sometimes absent default to None and are left out of the
JSON when not set (gateway/api/openai/schemas.dump).

Threading: pure data, any thread.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# -- request bodies ---------------------------------------------------------------


class Block(BaseModel):
    """One content block; which fields matter depends on `type`."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs: the answer is JSON matching `format.schema`."""

    model_config = ConfigDict(extra="ignore")
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _checks(self) -> CountTokensRequest:
        for t in self.tools or []:
            if t.type not in (None, "custom"):
                raise ValueError(f"tool type {t.type!r} is not supported (custom tools only)")
        choice = self.tool_choice
        if (
            choice is not None
            and choice.type == "tool"
            and not any(t.name == choice.name for t in self.tools or [])
        ):
            raise ValueError("tool_choice names a tool that is not in tools")
        return self


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


# -- responses ----------------------------------------------------------------------


class ContentBlock(BaseModel):
    """An answer's content block, with its type's fields only."""

    type: Literal["thinking", "text", "tool_use"]
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """/v1/messages answers every error in this shape, including those raised before
    its handler runs (auth, routing, body size)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class TokenCount(BaseModel):
    input_tokens: int
