"""One request's generation, from validated body to text deltas.

`prepare()` turns a chat or completion request into token ids and an `Add`
message (template, tokenization, limits: a prompt that can never fit is a 400
before anything is queued). `Generation` submits it to the worker, turns the
token ids that arrive into text through the request's `TextStream`, sends an
Abort when a stop string matches or the consumer goes away, and guarantees
exactly one terminal outcome.

Threading: event loop only.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import Settings
from gateway.http.errors import APIError
from gateway.serving.chat import ChatPlan, plan_chat, response_grammar
from gateway.serving.grammars import compact_json
from gateway.serving.reasoning import OutputFormat, OutputSplitter
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest
from gateway.serving.tokenizer import Frontend, TemplateError
from gateway.workers.client import Delta, MessageTooLarge, RequestStream, WorkerClient
from gateway.workers.crash_ledger import POISON_DEATHS
from protocol.messages import Add, SamplingParams

# The error of a request dropped because it was in flight for POISON_DEATHS
# worker deaths (gateway/workers/crash_ledger.py): the routes answer it with a 500.
POISON_ERROR = "request_crashed_worker"


@dataclass(slots=True)
class Prepared:
    request_id: str
    prompt: list[int]
    max_tokens: int
    stops: list[str]
    add: Add
    top_logprobs: int | None  # None: no logprobs requested
    output: OutputFormat | None = None  # chat: reasoning / tool-call split (serving/reasoning)
    prompt_text: str = ""  # completions: the prompt as text (echo, text_offset)


@dataclass(slots=True)
class Chunk:
    """What one wake-up of the consumer yields: new text and the tokens behind it."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    finish_reason: str | None = None
    error: str = ""
    reset: bool = False  # the request was replayed: drop everything received so far
    reasoning: str = ""  # chat: reasoning text (never part of `text`)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat: completed calls
    index: int = 0  # which choice (serving/choices.py) it belongs to


@dataclass(slots=True)
class Trace:
    """Stage timestamps (time.monotonic) of one request."""

    arrival: float = field(default_factory=time.monotonic)
    tokenized: float | None = None
    submitted: float | None = None
    prefill_start: float | None = None  # the worker admitted it (gateway clock)
    prefill_end: float | None = None  # its first token was ready
    first_token: float | None = None
    first_byte: float | None = None
    retired: float | None = None


async def _completion_prompt(
    body: CompletionRequest, frontend: Frontend, vocab_size: int
) -> tuple[list[int], str]:
    """A completion's prompt ids, and its text for echo and text_offset only
    (token-id prompts are decoded, off the event loop, only when those need it)."""
    raw = body.prompt_input()
    prompt = await frontend.encode(raw) if isinstance(raw, str) else list(raw)
    if vocab_size and any(t < 0 or t >= vocab_size for t in prompt):
        raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    prompt_text = raw if isinstance(raw, str) else ""
    if not isinstance(raw, str) and (body.echo or body.logprobs is not None):
        prompt_text = await frontend.run(frontend.decode, prompt)
    return prompt, prompt_text


async def prepare(
    body: ChatCompletionRequest | CompletionRequest,
    frontend: Frontend,
    settings: Settings,
    context_length: int,
    request_id: str,
    vocab_size: int = 0,
) -> Prepared:
    try:
        if isinstance(body, ChatCompletionRequest):
            plan = await plan_chat(body, frontend)
            prompt = plan.prompt
            top = body.top_logprobs or 0 if body.logprobs else None
        else:
            plan = ChatPlan([])
            grammar = await response_grammar(body.response_format, frontend)
            if grammar:
                plan.constraint = compact_json({"grammar": grammar})
            prompt, prompt_text = await _completion_prompt(body, frontend, vocab_size)
            top = body.logprobs
    except TemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    if not prompt:
        raise APIError(400, "the prompt is empty after tokenization", param="prompt")
    if settings.max_prompt_tokens and len(prompt) > settings.max_prompt_tokens:
        raise APIError(
            400,
            f"prompt has {len(prompt)} tokens, over this server's limit of "
            f"{settings.max_prompt_tokens}",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    room = context_length - len(prompt)
    requested = body.max_new_tokens
    if settings.max_tokens_limit and requested and requested > settings.max_tokens_limit:
        raise APIError(
            400, f"max_tokens is limited to {settings.max_tokens_limit}", param="max_tokens"
        )
    if room < 1 or (requested is not None and requested > room):
        raise APIError(
            400,
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{len(prompt)} tokens and max_tokens is {requested or 1}",
            param="max_tokens" if room >= 1 else "messages",
            code="context_length_exceeded",
        )
    max_tokens = requested if requested is not None else min(settings.default_max_tokens, room)
    stops = body.stop_list
    if len(stops) > settings.max_stop_strings:
        raise APIError(
            400, f"at most {settings.max_stop_strings} stop strings are allowed", param="stop"
        )
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias={**(body.logit_bias or {}), **plan.logit_bias},
    )
    add = Add(
        request_id=request_id,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        priority=0 if body.priority == "interactive" else 1,
        logprobs=top is not None,
        top_logprobs=top or 0,
        constraint=plan.constraint,
    )
    prepared = Prepared(request_id, prompt, max_tokens, stops, add, top, plan.output)
    if isinstance(body, CompletionRequest):
        prepared.prompt_text = prompt_text
    return prepared


class ClientSource(Protocol):
    """Where a Generation gets a (new) worker connection: gateway/workers/served_model."""

    async def acquire_client(self, timeout_s: float) -> WorkerClient: ...


class Generation:
    """Submit one prepared request and iterate over its text chunks.

    Always use as `async with`: leaving the block early (client gone, error,
    cancellation) aborts the request in the worker exactly once.

    If the worker dies before this request sent its client a byte
    (`trace.first_byte` unset), the request is replayed on the next worker
    under the same request id, up to `replay_limit` (at most 1) times; the
    consumer sees one `Chunk(reset=True)` and must drop whatever it collected
    so far. A request in flight for POISON_DEATHS worker deaths is dropped with
    a POISON_ERROR (gateway/workers/crash_ledger.py).
    """

    def __init__(
        self,
        client: WorkerClient,
        frontend: Frontend,
        prepared: Prepared,
        trace: Trace,
        source: ClientSource | None = None,
        replay_limit: int = 0,
        replay_timeout_s: float = 60.0,
    ) -> None:
        self.client = client
        self.frontend = frontend
        self.prepared = prepared
        self.trace = trace
        self.text = frontend.text_stream(prepared.stops, prepared.prompt)
        self.splitter = OutputSplitter(prepared.output) if prepared.output else None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error = ""
        self.replays = 0
        self.deaths = 0  # worker deaths this request was in flight for
        self._source = source
        self._replay_limit = replay_limit if source is not None else 0
        self._replay_timeout_s = replay_timeout_s
        self._stream: RequestStream | None = None

    async def __aenter__(self) -> Generation:
        self._stream = _submit(self.client, self.prepared.add)
        self.trace.submitted = time.monotonic()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"
        self.client.abort(self.prepared.request_id)  # no-op if the worker retired it
        self.trace.retired = time.monotonic()

    @property
    def cached_tokens(self) -> int:
        return self._stream.cached_tokens if self._stream is not None else 0

    def _replayable(self, delta: Delta) -> bool:
        return (
            delta.worker_lost
            and self.trace.first_byte is None
            and self.replays < self._replay_limit
        )

    async def _replay(self) -> None:
        assert self._source is not None
        self.replays += 1
        self.client = await self._source.acquire_client(self._replay_timeout_s)
        self.text = self.frontend.text_stream(self.prepared.stops, self.prepared.prompt)
        if self.prepared.output is not None:
            self.splitter = OutputSplitter(self.prepared.output)
        self.completion_tokens = 0
        self.trace.first_token = None
        self._stream = _submit(self.client, self.prepared.add)

    async def chunks(self) -> AsyncIterator[Chunk]:
        assert self._stream is not None, "use `async with`"
        while self.finish_reason is None:
            stream = self._stream
            delta = await stream.next()
            if delta.worker_lost:
                self.deaths += 1
                if self.deaths >= POISON_DEATHS:
                    delta.error = (
                        f"{POISON_ERROR}: the worker crashed {self.deaths} times while this "
                        f"request was in flight, so it is not retried ({delta.error})"
                    )
                    delta.worker_lost = False  # the request's fault, not availability
            if self._replayable(delta):
                await self._replay()
                yield Chunk("", [], reset=True)
                continue
            if delta.token_ids and self.trace.first_token is None:
                self.trace.first_token = stream.first_token_at or time.monotonic()
                self.trace.prefill_start = stream.prefill_start_at
                self.trace.prefill_end = stream.first_token_at
            self.completion_tokens += len(delta.token_ids)
            reason = delta.finish_reason
            out = self.text.add(delta.token_ids, final=reason is not None)
            if out.stopped:
                reason = "stop"
                self.client.abort(self.prepared.request_id)
            split = None
            if self.splitter is not None:
                split = self.splitter.feed(out.text, final=reason is not None)
                if reason == "stop" and self.splitter.tool_calls_made:
                    reason = "tool_calls"
            if reason == "rejected":
                raise APIError(400, delta.error or "the worker rejected the request")
            if reason == "error":
                self.error = delta.error or "generation failed"
                if delta.worker_lost:
                    self.error = "worker_restarted: " + self.error
            elif reason == "abort":
                # The worker only aborts on our behalf; seeing it here means
                # the request was dropped underneath us.
                reason, self.error = "error", delta.error or "request aborted by the worker"
            self.finish_reason = reason
            if out.text or delta.token_ids or reason:
                yield Chunk(
                    out.text if split is None else split.content,
                    delta.token_ids,
                    delta.logprobs,
                    delta.top_logprobs,
                    reason,
                    self.error,
                    reasoning=split.reasoning if split is not None else "",
                    tool_calls=split.tool_calls if split is not None else [],
                )


def _submit(client: WorkerClient, add: Add) -> RequestStream:
    """client.add, with a message over the worker's frame limit as a 400 (nothing sent)."""
    try:
        return client.add(add)
    except MessageTooLarge as e:
        raise APIError(400, str(e), code="request_too_large") from None
