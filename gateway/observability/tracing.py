"""A finished request's record: stage timestamps, the request-log fields, Chrome traces.

`RequestRecord` is built once per finished request by the request middleware
(gateway/http/app.py) from the request's `Trace` (gateway/serving/generation.py) and what the
handlers noted on the request. The same record feeds the JSON request log line,
the per-request metrics (gateway/observability/metrics.py) and, in trace mode, `TraceWriter`.

Stages (monotonic seconds): arrival, tokenized, admitted (got an in-flight
slot), submitted (Add sent to the worker), prefill_start, prefill_end,
first_token, first_byte, retired, plus cancelled when the client went away.
`Trace` fields named like a stage are used as they are, so stages the worker
reports later (prefill start/end) appear without changes here.

`TraceWriter` writes Chrome trace events (JSON array format, which Perfetto and
chrome://tracing load): one lane per concurrently running request, a span per
request with nested tokenize/queue/prefill/decode spans, and an instant event
per stage. Events are appended and flushed per request, so a trace of a
process that was killed still loads once a closing `]` is added; a clean
shutdown writes it.

Threading: event loop only. One small buffered write per finished request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gateway.observability.log_safety import cap

STAGES = (
    "arrival",
    "tokenized",
    "admitted",
    "submitted",
    "prefill_start",
    "prefill_end",
    "first_token",
    "first_byte",
    "retired",
)


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1e3, 2)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    endpoint: str  # the route's pattern: a bounded metric label
    status: int
    start: float  # middleware entry (monotonic)
    end: float  # middleware exit
    stages: dict[str, float] = field(default_factory=dict)
    model: str | None = None
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    stream: bool | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    error: str | None = None
    api_key: str | None = None  # the key's label, never the key
    rejected: str | None = None  # "queue_full" / "rate_limited": refused by admission
    generation: bool = False  # a completion request that reached the model
    client_request_id: str | None = None  # the client's X-Request-ID: a label, never a key

    @property
    def arrival(self) -> float:
        return self.stages.get("arrival", self.start)

    @property
    def queue_time_s(self) -> float | None:
        sub = self.stages.get("submitted")
        return None if sub is None else sub - self.arrival

    @property
    def ttft_s(self) -> float | None:
        ft = self.stages.get("first_token")
        return None if ft is None else ft - self.arrival

    @property
    def latency_s(self) -> float:
        return self.end - self.arrival

    @property
    def cancel_to_retire_s(self) -> float | None:
        c, r = self.stages.get("cancelled"), self.stages.get("retired")
        return None if c is None or r is None else max(0.0, r - c)

    @property
    def cancel_stage(self) -> str:
        """Where a cancelled request was: queued, prefill (no token yet) or decode."""
        s = self.stages
        if s.get("submitted") is None:
            return "queued"
        return "prefill" if s.get("first_token") is None else "decode"

    def log_fields(self) -> dict[str, Any]:
        """The request log line's fields; every key is always present."""
        return {
            "request_id": self.request_id,
            # Client-controlled values are capped (gateway/observability/log_safety).
            "client_request_id": cap(self.client_request_id),
            "method": self.method,
            "path": cap(self.path),
            "status": self.status,
            "model": cap(self.model),
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "queue_time_ms": _ms(self.arrival, self.stages.get("submitted")),
            "ttft_ms": _ms(self.arrival, self.stages.get("first_token")),
            "latency_ms": _ms(self.arrival, self.end),
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "cancelled": self.cancelled,
            "error": cap(self.error, 500),
            "key_name": self.api_key,
        }


def collect_stages(trace: Any, extra: dict[str, float | None]) -> dict[str, float]:
    """Stage timestamps from a Trace (any attribute named like a stage) and extras."""
    stages: dict[str, float] = {}
    for name in STAGES:
        value = getattr(trace, name, None) if trace is not None else None
        if value is None:
            value = extra.get(name)
        if value is not None:
            stages[name] = float(value)
    if (c := extra.get("cancelled")) is not None:
        stages["cancelled"] = float(c)
    return stages


class TraceWriter:
    """Appends Chrome trace events for finished requests to one file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._file: IO[str] | None = None
        # Monotonic origin of the trace's microsecond clock.
        self._t0 = time.monotonic()
        self._lanes: list[float] = []  # per lane: when its last request ended

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", encoding="utf-8")
        self._file.write("[\n")
        self._emit(
            {
                "name": "process_name",
                "ph": "M",
                "pid": 1,
                "tid": 0,
                "args": {"name": "mlxd gateway"},
            }
        )
        self._file.flush()

    def close(self) -> None:
        if self._file is None:
            return
        self._file.write(
            json.dumps(
                {
                    "name": "trace_end",
                    "ph": "i",
                    "s": "g",
                    "pid": 1,
                    "tid": 0,
                    "ts": self._us(time.monotonic()),
                }
            )
            + "\n]\n"
        )
        self._file.close()
        self._file = None

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 1)

    def _emit(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def _lane(self, start: float, end: float) -> int:
        for i, busy_until in enumerate(self._lanes):
            if busy_until <= start:
                self._lanes[i] = end
                return i + 1
        self._lanes.append(end)
        return len(self._lanes)

    def write(self, rec: RequestRecord) -> None:
        if self._file is None or not rec.generation:
            return
        s = rec.stages
        start, end = rec.arrival, rec.end
        tid = self._lane(start, end)
        args = {k: v for k, v in rec.log_fields().items() if v is not None}
        self._span("request", "request", start, end, tid, args)
        spans = (
            ("tokenize", "arrival", "tokenized"),
            ("queue", "tokenized", "admitted"),
            (
                "prefill",
                "prefill_start" if "prefill_start" in s else "submitted",
                "prefill_end" if "prefill_end" in s else "first_token",
            ),
            ("decode", "first_token", "retired"),
        )
        ids = {"request_id": rec.request_id}
        if rec.client_request_id is not None:
            ids["client_request_id"] = args["client_request_id"]  # capped
        for name, a, b in spans:
            if a in s and b in s and s[b] >= s[a]:
                self._span(name, "stage", s[a], s[b], tid, ids)
        for name, t in s.items():
            self._emit(
                {
                    "name": name,
                    "cat": "stage",
                    "ph": "i",
                    "s": "t",
                    "pid": 1,
                    "tid": tid,
                    "ts": self._us(t),
                    "args": ids,
                }
            )
        assert self._file is not None
        self._file.flush()

    def _span(
        self, name: str, cat: str, a: float, b: float, tid: int, args: dict[str, Any]
    ) -> None:
        self._emit(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": self._us(a),
                "dur": round((b - a) * 1e6, 1),
                "args": args,
            }
        )
