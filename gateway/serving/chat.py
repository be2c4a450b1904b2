"""Chat-specific preparation: template inputs, the decoding constraint, the output format.

`plan_chat` decides, for one chat request, before anything is queued:
- what the chat template renders: messages with tool calls and tool results,
  the tools (when the model supports them), and template switches such as
  `enable_thinking`;
- the decoding constraint sent to the worker (worker/constraints.py): a grammar
  for `response_format` or a forced tool call, and the thinking budget;
- the output format the answer is split by (gateway/serving/reasoning.py): reasoning
  markers, tool-call markers and parser, and whether the answer starts inside a
  reasoning block.
Every request it cannot honour is a 400 naming the field.

Threading: event loop; template and grammar work run in the tokenizer pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.http.errors import APIError
from gateway.serving import grammars
from gateway.serving.reasoning import NORMAL, REASONING, OutputFormat
from gateway.serving.requests import ChatCompletionRequest, NamedToolChoice, ResponseFormat, Tool
from gateway.serving.tokenizer import Frontend
from gateway.serving.tools import (
    JSON_CALL_PARSERS,
    forced_call_markers,
    require_tool_support,
    template_messages,
    template_tools,
)

# chat_template_kwargs that would clash with the arguments mlxd passes itself.
_RESERVED_KWARGS = frozenset(
    {"messages", "conversation", "tools", "tokenize", "add_generation_prompt", "return_dict"}
)
# A logit bias that no logit survives: keeps a token from ever being sampled.
BAN = -1e9


@dataclass(slots=True)
class ChatPlan:
    prompt: list[int]
    constraint: str = ""  # Add.constraint JSON; "" = none
    output: OutputFormat | None = None
    logit_bias: dict[str, float] = field(default_factory=dict)  # added to the request's


def _thinking_kwargs(body: ChatCompletionRequest, frontend: Frontend) -> dict[str, Any]:
    kwargs = {
        k: v for k, v in (body.chat_template_kwargs or {}).items() if k not in _RESERVED_KWARGS
    }
    thinking = body.enable_thinking
    if thinking is None:
        thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise APIError(400, "enable_thinking must be a boolean", param="enable_thinking")
    if thinking is not None:
        if not frontend.has_thinking:
            if thinking:
                raise APIError(400, "this model does not support thinking", param="enable_thinking")
            kwargs.pop("enable_thinking", None)  # already off
        elif not frontend.thinking_switch:
            raise APIError(
                400,
                "this model's chat template has no switch to turn thinking on or off",
                param="enable_thinking",
            )
        else:
            kwargs["enable_thinking"] = thinking
    if body.thinking_budget is not None and not frontend.has_thinking:
        raise APIError(400, "this model does not support thinking", param="thinking_budget")
    return kwargs


async def response_grammar(fmt: ResponseFormat | None, frontend: Frontend) -> str:
    """The validated grammar for a response_format ("" for text)."""
    schema = grammars.response_schema(fmt)
    if schema is None:
        return ""
    grammar = grammars.json_grammar(schema)
    await frontend.run(grammars.validate, grammar, "response_format")
    return grammar


async def _grammar(
    body: ChatCompletionRequest,
    frontend: Frontend,
    tools: list[Tool],
    choice: Any,
    use_tools: bool,
) -> str:
    """The constraint grammar ("" for none): a forced tool call, or the response format
    (with tool calls as an alternative when the model may still call tools)."""
    grammar, param = "", "response_format"
    schema = grammars.response_schema(body.response_format)
    if use_tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        markers = forced_call_markers(frontend)
        if isinstance(choice, NamedToolChoice):
            functions = [t.function for t in tools if t.function.name == choice.function.name]
            parallel = False
        else:
            functions, parallel = [t.function for t in tools], body.parallel_tool_calls
        grammar, param = grammars.tool_call_grammar(functions, markers, parallel), "tools"
    elif schema is not None and use_tools:
        if frontend.tool_parser_name not in JSON_CALL_PARSERS:
            raise APIError(
                400,
                "response_format with tools needs tool_choice 'none' for this model's "
                f"tool-call format ({frontend.tool_parser_name})",
                param="response_format",
            )
        markers = forced_call_markers(frontend)
        functions = [t.function for t in tools]
        grammar = grammars.tool_call_grammar(
            functions, markers, body.parallel_tool_calls, alternative=schema
        )
    elif schema is not None:
        grammar = grammars.json_grammar(schema)
    if grammar:
        await frontend.run(grammars.validate, grammar, param)
    return grammar


async def plan_chat(body: ChatCompletionRequest, frontend: Frontend) -> ChatPlan:
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    use_tools = bool(tools) and choice != "none"
    if use_tools:
        require_tool_support(frontend)
    kwargs = _thinking_kwargs(body, frontend)
    rendered_tools = template_tools(tools) if tools and frontend.has_tool_calling else None
    prompt = await frontend.chat_prompt(template_messages(body.messages), rendered_tools, kwargs)
    plan = ChatPlan(prompt)

    grammar = await _grammar(body, frontend, tools, choice, use_tools)

    # Reasoning: the grammar starts after the block closes; the budget closes it.
    thinking_on = kwargs.get("enable_thinking") is not False
    active = frontend.ends_in_reasoning(prompt)
    reasoning = None
    if frontend.has_thinking and (active or thinking_on):
        assert frontend.think_start is not None and frontend.think_end is not None
        reasoning = {
            "start": frontend.marker_ids(frontend.think_start) if thinking_on else [],
            "end": frontend.marker_ids(frontend.think_end),
            "active": active,
            "budget": body.thinking_budget or 0,
        }
    spec: dict[str, Any] = {}
    if grammar:
        spec["grammar"] = grammar
    if reasoning is not None and (grammar or reasoning["budget"]):
        spec["reasoning"] = reasoning
    if spec:
        plan.constraint = grammars.compact_json(spec)

    think = None
    if frontend.has_thinking:
        assert frontend.think_start is not None and frontend.think_end is not None
        think = (frontend.think_start, frontend.think_end)
    tool = None
    if use_tools:
        assert frontend.tool_start is not None and frontend.tool_end is not None
        tool = (frontend.tool_start, frontend.tool_end)
    if think is not None or tool is not None:
        plan.output = OutputFormat(
            think=think,
            tool=tool,
            parser=frontend.tool_parser if use_tools else None,
            tools=rendered_tools if use_tools else None,
            initial=REASONING if active else NORMAL,
        )
    if tools and choice == "none" and frontend.has_tool_calling:
        # The model was shown the tools but must not call them.
        assert frontend.tool_start is not None
        start_ids = frontend.marker_ids(frontend.tool_start)
        if len(start_ids) == 1:
            plan.logit_bias[str(start_ids[0])] = BAN
    return plan
