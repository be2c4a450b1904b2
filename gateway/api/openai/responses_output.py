"""A response's output items, built from its chunks, and the stream events that build them.

Streams and complete answers (gateway/api/openai/responses.py) both go through
`OutputBuilder`, so they agree: a `reasoning` item, a `message` item with one
`output_text` part, one `function_call` item per tool call, in the order the model
wrote them, and the `response.*` events a stream sends for each.

Threading: event loop only (one request's builder).
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from gateway.serving.generation import Chunk, Generation
from gateway.serving.reasoning import REASONING

_PART_TYPES = {"reasoning": "reasoning_text", "message": "output_text"}
_DELTA_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class OutputBuilder:
    """One response's output items, built from its chunks, and the stream events that
    build them. Streams and complete answers both go through it, so they agree.

    Events carry consecutive `sequence_number`s from `seq`. Events are rendered to
    bytes at once by the stream, but they hold copies of items anyway: an item
    changes after its `added` event (its text, its status).
    """

    def __init__(self, gen: Generation, seq: int = 0) -> None:
        self.gen = gen
        self.items: list[dict[str, Any]] = []
        self.seq = seq
        self._token_ids: list[int] = []
        self._approx_reasoning = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written
        self._text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def feed(self, c: Chunk) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if c.reasoning:
            events += self._write("reasoning", c.reasoning)
        if c.text:
            events += self._write("message", c.text)
        for call in c.tool_calls:
            events += self._call(call)
        self._count(c)
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close the open item (an empty message when nothing was written at all)."""
        events = self._start("message") if not self.items else []
        return events + self._close(incomplete)

    def reasoning_tokens(self) -> int:
        """Tokens generated for the reasoning block, its markers included (usage).

        Counted on the token ids when the model's markers are single tokens (they
        are special tokens in thinking models); otherwise from the chunks, where a
        chunk that carries both reasoning and other output (a reader that fell
        behind) is shared out by characters.
        """
        fmt = self.gen.prepared.output
        if fmt is None or fmt.think is None:
            return 0
        start, end = (self.gen.frontend.marker_ids(m) for m in fmt.think)
        if len(start) != 1 or len(end) != 1:
            return self._approx_reasoning
        count, inside = 0, fmt.initial == REASONING
        for tok in self._token_ids:
            if not inside and tok == start[0]:
                inside = True
            if inside:
                count += 1
                inside = tok != end[0]
        return count

    def _count(self, c: Chunk) -> None:
        self._token_ids += c.token_ids
        other = len(c.text) + sum(len(t["function"]["arguments"]) for t in c.tool_calls)
        n = len(c.token_ids)
        if c.reasoning:
            self._approx_reasoning += round(n * len(c.reasoning) / (len(c.reasoning) + other))
        elif not other and self.gen.splitter is not None and self.gen.splitter.state == REASONING:
            self._approx_reasoning += n  # held back or marker tokens inside the block

    def _start(self, kind: str) -> list[dict[str, Any]]:
        item: dict[str, Any] = {"id": new_id("rs_" if kind == "reasoning" else "msg_")}
        if kind == "reasoning":
            item.update(type="reasoning", summary=[], content=[], status="in_progress")
        else:
            item.update(type="message", status="in_progress", role="assistant", content=[])
        self.items.append(item)
        self._open, self._text = item, ""
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return [
            self.event(
                "response.output_item.added", output_index=where["output_index"], item=dict(item)
            ),
            self.event(
                "response.content_part.added", **where, content_index=0, part=self._part(kind, "")
            ),
        ]

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": _PART_TYPES[kind], "text": text}
        if kind == "message":
            part.update(annotations=[], logprobs=[])
        return part

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close(False)
            events += self._start(kind)
        assert self._open is not None
        self._text += text
        delta: dict[str, Any] = {
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            delta["logprobs"] = []
        events.append(self.event(_DELTA_EVENTS[kind] + ".delta", **delta))
        return events

    def _close(self, incomplete: bool) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        kind = item["type"]
        part = self._part(kind, self._text)
        item["content"] = [part]
        item["status"] = "incomplete" if incomplete else "completed"
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        done: dict[str, Any] = {"text": self._text}
        if kind == "message":
            done["logprobs"] = []
        return [
            self.event(_DELTA_EVENTS[kind] + ".done", **where, **done),
            self.event("response.content_part.done", **where, part=dict(part)),
            self.event(
                "response.output_item.done",
                output_index=where["output_index"],
                item=copy.deepcopy(item),
            ),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool call arrives whole (gateway/serving/reasoning.py): all its events at once."""
        events = self._close(False)
        fn = call["function"]
        item = {
            "id": new_id("fc_"),
            "type": "function_call",
            "status": "completed",
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
        }
        self.items.append(item)
        index = len(self.items) - 1
        added = {**item, "status": "in_progress", "arguments": ""}
        where = {"item_id": item["id"], "output_index": index}
        return [
            *events,
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **where, delta=fn["arguments"]),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=fn["name"],
                arguments=fn["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=dict(item)),
        ]
