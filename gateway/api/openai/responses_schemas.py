"""Request bodies of the Responses API (POST /v1/responses), and their chat equivalent.

`CreateResponseRequest` validates the body. Items of `input` share one permissive
model (`ResponsesInputItem`) whose validator checks what each item type needs, so
an error names the item (`input.2: ...`). `to_chat` turns the conversation (a
stored one's items, then the request's) into the equivalent /v1/chat/completions
body, which gateway/serving/requests.ChatCompletionRequest validates and the chat
path serves:

- `instructions` and system/developer messages -> system messages (chat templates
  know `system`; OpenAI's `developer` role is its equivalent);
- user and assistant messages -> messages with their text parts (`input_text`,
  `output_text`); other content (images, files, audio) is a 400;
- `reasoning` items -> the next assistant turn's `reasoning_content`;
- `function_call` items -> that turn's `tool_calls`; `function_call_output` items
  -> `tool` messages;
- function tools, `tool_choice` (`allowed_tools` restricts the tools offered),
  `text.format` -> `response_format`, `reasoning.effort` -> `enable_thinking`,
  `max_output_tokens` -> `max_tokens`, and mlxd's chat extensions as they are.

Fields whose meaning mlxd does not implement are refused with a 400 naming them
(see `_REFUSED` and the validators) rather than ignored.

Threading: pure (pydantic models and functions).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Fields with a meaning mlxd does not implement: a non-null value is a 400.
_REFUSED = {
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
    "context_management": "context management is not supported",
    "moderation": "moderation is not supported",
}
# Chat extensions a Responses request may carry too (docs/api.md, chat request fields).
CHAT_EXTENSIONS = (
    "seed",
    "top_k",
    "min_p",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "priority",
    "enable_thinking",
    "chat_template_kwargs",
    "thinking_budget",
)
# `include` values that need nothing mlxd lacks. Reasoning is returned in clear
# (`content`), so there is never encrypted content to include.
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})


class ResponsesContentPart(BaseModel):
    """One part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None

    def text_of(self) -> str:
        if self.type in ("input_text", "output_text", "reasoning_text", "summary_text"):
            return self.text or ""
        if self.type == "refusal":
            return self.refusal or ""
        raise ValueError(f"content part type {self.type!r} is not supported (text only)")


def _join(content: str | list[ResponsesContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text_of() for p in content)


class ResponsesInputItem(BaseModel):
    """An item of `input`: a message, a function call, its output, or reasoning."""

    model_config = ConfigDict(extra="allow")
    type: str = "message"  # an EasyInputMessage may leave it out
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ResponsesContentPart] | None = None
    status: str | None = None
    # function_call / function_call_output
    call_id: str | None = Field(None, min_length=1, max_length=64)
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponsesContentPart] | None = None
    # reasoning
    summary: list[ResponsesContentPart] | None = None
    encrypted_content: str | None = None

    @model_validator(mode="after")
    def _fields_of_type(self) -> ResponsesInputItem:
        needs = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
            "reasoning": (),
        }.get(self.type)
        if needs is None:
            raise ValueError(
                f"input item type {self.type!r} is not supported (messages, function_call, "
                "function_call_output and reasoning items only)"
            )
        missing = [f for f in needs if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {', '.join(missing)}")
        self.text()  # raises for parts that are not text
        return self

    def text(self) -> str:
        """The item's text: a message's content, an output, or a reasoning text."""
        if self.type == "function_call_output":
            return _join(self.output)
        if self.type == "reasoning":
            text = _join(self.content if isinstance(self.content, list) else None)
            return text or _join(self.summary)
        return _join(self.content)


class ResponsesFunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function":
            raise ValueError(f"tool type {kind!r} is not supported (function tools only)")
        return data


class ResponsesToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class ResponsesToolChoiceAllowed(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]

    def names(self) -> set[str]:
        return {t.get("name", "") for t in self.tools if t.get("type") == "function"}


class ResponsesTextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponsesTextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs schema")
        return self

    def echo(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "json_schema":
            out.update(name=self.name or "response", schema=self.schema_, strict=self.strict)
            if self.description is not None:
                out["description"] = self.description
        return out


class ResponsesTextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: ResponsesTextFormat | None = None
    # Only the default: mlxd cannot make a model terser or wordier on request.
    verbosity: Literal["medium"] | None = None


class ResponsesReasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Accepted; mlxd returns the reasoning text itself, never a summary (docs/api.md).
    summary: Literal["auto", "concise", "detailed"] | None = None


def _string_or_items(schema: dict[str, Any]) -> None:
    """`input`'s JSON schema: a string, or the list of items it is validated as."""
    items = dict(schema)
    schema.clear()
    schema["anyOf"] = [{"type": "string"}, items]


ToolChoice = (
    Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | ResponsesToolChoiceAllowed
)


class CreateResponseRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    # A string is one user message (converted before validation, so that an error
    # names the item instead of the union's string branch).
    input: list[ResponsesInputItem] = Field(json_schema_extra=_string_or_items)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to hide
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoning | None = None
    max_output_tokens: int | None = Field(None, ge=16)  # the spec's minimum
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    truncation: Literal["disabled"] | None = None  # "auto" would drop input silently
    background: bool | None = None
    include: list[str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # limits built-in tools, which mlxd has none of

    @field_validator("input", mode="before")
    @classmethod
    def _string_input(cls, v: Any) -> Any:
        return [{"type": "message", "role": "user", "content": v}] if isinstance(v, str) else v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_kind(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") not in ("function", "allowed_tools"):
            raise ValueError(f"tool_choice type {v.get('type')!r} is not supported")
        return v

    @field_validator("include")
    @classmethod
    def _includable(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if name not in _INCLUDABLE:
                raise ValueError(f"{name!r} is not supported")
        return v

    @model_validator(mode="after")
    def _checks(self) -> CreateResponseRequest:
        extra = self.model_extra or {}
        for name, why in _REFUSED.items():
            if extra.get(name) is not None:
                raise ValueError(f"{name}: {why}")
        if self.background:
            raise ValueError("background: background responses are not supported")
        if self.top_logprobs:
            raise ValueError("top_logprobs: logprobs are not supported on /v1/responses")
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools share a name")
        choice = self.tool_choice
        if isinstance(choice, ResponsesToolChoiceFunction) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        if isinstance(choice, ResponsesToolChoiceAllowed):
            if any(t.get("type") != "function" for t in choice.tools):
                raise ValueError("tool_choice.tools: only function tools are supported")
            if not choice.names() or not choice.names() <= set(names):
                raise ValueError("tool_choice.tools must name functions that are in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if not self.input and self.previous_response_id is None:
            raise ValueError("input must not be empty")
        return self

    def input_items(self) -> list[ResponsesInputItem]:
        return list(self.input)

    @property
    def text_format(self) -> ResponsesTextFormat:
        fmt = self.text.format if self.text is not None else None
        return fmt or ResponsesTextFormat.model_validate({"type": "text"})


# -- responses ------------------------------------------------------------------------


class ResponseItem(BaseModel):
    """An output item: `message`, `reasoning` or `function_call`, with that type's fields."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["message", "reasoning", "function_call"]


class ResponseUsage(BaseModel):
    model_config = ConfigDict(extra="allow")
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] | None = None
    output_tokens_details: dict[str, int] | None = None


class ResponseObject(BaseModel):
    """A response, as POST /v1/responses answers it and GET /v1/responses/{id} returns it.

    The handlers (gateway/api/openai/responses.py) validate every response object they
    send through this class; the fields it does not name pass through unchanged.
    """

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[ResponseItem]
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None
    usage: ResponseUsage | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]
