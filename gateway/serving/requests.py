"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Unknown fields are accepted (clients send many harmless ones), except fields
whose meaning we do not implement: those are refused with a 400 naming the
field rather than silently ignored (see UNSUPPORTED).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Fields a client may send that mlxd does not implement (yet): refusing them is
# better than returning output that silently ignored them.
# (tools, tool_choice, parallel_tool_calls are fields of chat requests, so this
# refuses them on /v1/completions only.)
UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "audio",
    "prediction",
    "suffix",
)
# The most choices one request may ask for (`n`): each is a batch row in the worker.
MAX_CHOICES = 16
# The most prompts one /v1/completions request may list.
MAX_PROMPTS = 64


# -- tools (gateway/serving/tools.py) ------------------------------------------------------


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(BaseModel):
    model_config = ConfigDict(extra="ignore")
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice]  # each entry has a named tool choice's shape


class AllowedToolsChoice(BaseModel):
    """`tool_choice: {"type": "allowed_tools", ...}`: the model is offered only these tools."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.schema_ is None
        ):
            raise ValueError("response_format json_schema needs json_schema.schema")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=2**31 - 1)  # bounded: it travels as a msgpack int
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    # vLLM's extension: return the generated (and prompt) token ids.
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None  # enforced by gateway/serving/grammars.py

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # The spec marks the optional fields nullable, and the OpenAI SDK sends
        # null for an argument passed as None: null means "the default". Dropping
        # the key (rather than validating None) also keeps it out of
        # model_fields_set, so a model profile's default applies (_with_profile).
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        for k, bias in v.items():
            # ASCII digits only: str.isdigit() also accepts "\u00b2" and "\u0661", which int()
            # refuses or reads as another number; ten digits hold any token id.
            if not (0 < len(k) <= 10 and k.isascii() and k.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {k[:24]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias values must be between -100 and 100")
        return v

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Common:
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            if extra.get(name) not in (None, [], False):
                raise ValueError(f"{name!r} is not supported by this server")
        modalities = extra.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise ValueError("'modalities': only ['text'] is supported by this server")
        if extra.get("web_search_options") not in (None, {}):
            raise ValueError("'web_search_options' is not supported by this server (no search)")
        return self

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # normalised to a list by the validator


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results
    reasoning_content: str | None = None  # an earlier turn's reasoning, if the client keeps it

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise ValueError(f"content part type {p.type!r} is not supported (text only)")
            parts.append(p.text)
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: (
        Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None
    ) = None
    parallel_tool_calls: bool = True
    # Thinking: DashScope's top-level switch, or vLLM's chat_template_kwargs.
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = Field(None, ge=1)  # most reasoning tokens, then it closes

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, AllowedToolsChoice):
            self._restrict_tools(self.tool_choice.allowed_tools)
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if not any(t.function.name == name for t in self.tools or []):
                raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        if self.tools is not None and len({t.function.name for t in self.tools}) != len(self.tools):
            raise ValueError("tools: two tools share a name")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        for m in self.messages:
            m.text()  # raises for non-text parts
        return self

    def _restrict_tools(self, allowed: AllowedTools) -> None:
        """allowed_tools: offer the model only the named tools, then behave as `mode`.

        The rest of `tools` is not rendered into the prompt, so the model cannot
        call them; "required" then forces a call to one of the allowed tools.
        """
        names = [t.function.name for t in allowed.tools]
        known = {t.function.name for t in self.tools or []}
        for name in names:
            if name not in known:
                raise ValueError(f"tool_choice.allowed_tools names {name!r}, which is not in tools")
        if not names:
            raise ValueError("tool_choice.allowed_tools.tools must name at least one tool")
        self.tools = [t for t in self.tools or [] if t.function.name in names]
        self.tool_choice = allowed.mode

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1)

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            # OpenAI's echo + logprobs covers the prompt's tokens too; the worker
            # computes no prompt logprobs.
            raise ValueError("echo with logprobs is not supported (no prompt logprobs)")
        p = self.prompt
        if isinstance(p, list):
            if len(p) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(p[0], (str, list)) and len(p) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if len(self.prompt_inputs()) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_CHOICES} choices per request")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_inputs(self) -> list[str | list[int]]:
        """Every prompt, as text or token ids (a list of prompts gives several)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]  # type: ignore[list-item]

    def prompt_input(self) -> str | list[int]:
        """The first prompt as text or token ids."""
        return self.prompt_inputs()[0]
