"""Splitting a chat answer into content, reasoning and tool calls as it streams.

Models with thinking tokens write their reasoning between markers (`<think>` ...
`</think>`); tool-capable models wrap calls in their own markers (`<tool_call>`
... `</tool_call>` for Hermes/Qwen). `OutputSplitter` runs mlx-lm's
`TextStateMachine` over the detokenized text, so a marker is recognised even when
it arrives split across tokens or steps (text that could still be the start of a
marker is held back until it is known not to be one), strips the markers, and
routes the text: reasoning -> `reasoning`, everything outside -> `content`, each
completed tool call -> parsed with the model's mlx-lm tool parser and returned
as an OpenAI tool call (`{id, type: "function", function: {name, arguments}}`).

Matching on text rather than token ids keeps it robust to tokenizations that
merge a marker's last character with the next byte. Whitespace-only content is
held back until more text follows, and dropped when it only separates tool calls
(`\n` between parallel calls is layout, not an answer).

Threading: event loop only; one splitter per request (and per replay).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.serving.tokenizer import text_state_machine

log = logging.getLogger("mlxd.gateway.reasoning")

NORMAL, REASONING, TOOL = "normal", "reasoning", "tool"


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What one request's output may contain, decided at prepare time."""

    think: tuple[str, str] | None = None  # (start, end) markers; None: no reasoning split
    tool: tuple[str, str] | None = None  # (start, end) markers; None: no tool parsing
    parser: Callable[[str, Any], Any] | None = None  # mlx-lm parse_tool_call(text, tools)
    tools: list[dict[str, Any]] | None = None  # the request's tools, for the parser
    initial: str = NORMAL  # REASONING when the prompt left a reasoning block open


@dataclass(slots=True)
class Split:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def format_tool_calls(parsed: Any) -> list[dict[str, Any]]:
    """mlx-lm parser output (a dict or a list of them) -> OpenAI tool calls."""
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"not a tool call: {item!r}")
        args = item.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": item.get("id") or new_call_id(),
                "type": "function",
                "function": {"name": item["name"], "arguments": args},
            }
        )
    return calls


class OutputSplitter:
    """One request's content / reasoning / tool-call splitter."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        transitions: dict[str, list[tuple[str, str]]] = {NORMAL: []}
        if fmt.think is not None:
            transitions[NORMAL].append((fmt.think[0], REASONING))
            transitions[REASONING] = [(fmt.think[1], NORMAL)]
        if fmt.tool is not None:
            transitions[NORMAL].append((fmt.tool[0], TOOL))
            if fmt.think is not None:
                transitions[REASONING].append((fmt.tool[0], TOOL))
            transitions[TOOL] = [(fmt.tool[1], NORMAL)]
        self._machine = machine = text_state_machine()
        self._sm = machine(transitions)
        self._state = self._sm.make_state(fmt.initial)
        self._prev = fmt.initial
        self._tool_text = ""
        self._blank = ""  # whitespace-only content held back (see feed)
        self.tool_calls_made = 0

    @property
    def state(self) -> str:
        """Where the text fed so far ended: NORMAL, REASONING or TOOL (the Responses
        API counts reasoning tokens by it when a model's markers span several tokens)."""
        return self._prev

    def feed(self, text: str, final: bool = False) -> Split:
        out = Split()
        state, segments = self._machine.split(self._state, text)
        if final:
            state, flushed, current = self._machine.flush(state)
            segments.append((current, flushed))
        self._state = state
        for name, piece in segments:
            if self._prev == TOOL and name != TOOL:
                self._finish_tool(out, closed=True)
            if name == REASONING:
                out.reasoning += piece
            elif name == TOOL:
                self._blank = ""  # whitespace around tool calls is layout, not content
                self._tool_text += piece
            elif not piece or piece.isspace():
                self._blank += piece
            else:
                out.content += self._blank + piece
                self._blank = ""
            self._prev = name
        if final and self._prev == TOOL:
            self._finish_tool(out, closed=False)  # unterminated at the end of the answer
        if final and not self.tool_calls_made:
            out.content += self._blank
        return out

    def _finish_tool(self, out: Split, closed: bool) -> None:
        text, self._tool_text = self._tool_text, ""
        self._blank = ""
        fmt = self.fmt
        assert fmt.tool is not None and fmt.parser is not None
        try:
            calls = format_tool_calls(fmt.parser(text, fmt.tools))
        except Exception as e:  # parsers raise ValueError, KeyError, JSONDecodeError, ...
            # Nothing is lost: an unparseable call reaches the client as content.
            # The type only: the exception's text may quote the generated call.
            log.info("unparseable tool call (%s)", type(e).__name__)
            out.content += fmt.tool[0] + text + (fmt.tool[1] if closed else "")
            return
        for call in calls:  # `index`: the call's position in the answer (stream deltas)
            call["index"] = self.tool_calls_made
            self.tool_calls_made += 1
        out.tool_calls.extend(calls)
