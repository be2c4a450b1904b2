"""The driver every generating API shares: admission, preparation, collecting, streaming.

An API route (gateway/api/openai, gateway/api/anthropic) parses its body into the
canonical chat or completion request, then runs it through here:

- `admitted`: the model is resolved (404), a queue position is taken before
  anything else (503 when full), the model is leased (started first if it was
  stopped: a streaming request gets keep-alive comments meanwhile), the request
  is prepared (template, tokens, limits), then it waits for an in-flight slot.
  One deadline (`request_timeout_s` from arrival) bounds it all and ends in a
  clean 504.
- `collect`: a non-streaming answer's chunks, within the deadline.
- `pump`: a stream's chunks, rendered by the API, written through its SSEStream
  (gateway/http/sse.py); a failure after the first byte is the API's SSE error
  event.

Client disconnects cancel the handler (aiohttp's handler_cancellation), and the
Generation context aborts the request in the worker on the way out. Stage
timestamps go on the request for the request record (gateway/observability/tracing).

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from gateway.http.app_keys import METRICS, MODELS, SETTINGS
from gateway.http.errors import APIError
from gateway.http.request_state import state
from gateway.http.sse import KEEPALIVE_STARTING, SSEStream
from gateway.serving.admission import Ticket
from gateway.serving.choices import Choices, prepare_choices
from gateway.serving.generation import POISON_ERROR, Chunk, Generation, Prepared, Trace
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest
from gateway.serving.tokenizer import Frontend
from gateway.workers.client import WorkerClient
from gateway.workers.registry import HostedModel
from gateway.workers.served_model import ServedModel


def remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def timeout_error(request: web.Request) -> APIError:
    limit = request.app[SETTINGS].request_timeout_s
    state(request).finish_reason = "timeout"
    return APIError(504, f"the request did not finish within {limit:g} s", code="timeout")


def generation_failed(error: str) -> APIError:
    # A lost worker is the server's availability (503); anything else is a 500,
    # a request dropped for crashing the worker included (it would again).
    if error.startswith(POISON_ERROR):
        return APIError(500, f"generation failed: {error}", code=POISON_ERROR)
    status = 503 if "worker unavailable" in error else 500
    return APIError(status, f"generation failed: {error}", code="generation_failed")


def with_profile(
    body: ChatCompletionRequest | CompletionRequest, hosted: HostedModel
) -> ChatCompletionRequest | CompletionRequest:
    """The request with the model's default sampling in the fields it left out."""
    defaults = hosted.sampling_defaults()
    if not defaults:
        return body
    given = body.model_fields_set
    if "max_completion_tokens" in given:
        given = given | {"max_tokens"}
    update = {k: v for k, v in defaults.items() if k not in given and k in type(body).model_fields}
    return body.model_copy(update=update) if update else body


@dataclass(slots=True)
class Admitted:
    """A request that holds an in-flight slot, tokenized, with a live worker client."""

    client: WorkerClient
    frontend: Frontend
    prepared: Prepared
    trace: Trace
    deadline: float
    served: ServedModel
    sse: SSEStream | None  # a streaming request's response
    # n > 1 or several prompts: one per choice (serving/choices); [prepared] otherwise
    choices: list[Prepared]

    def generation(self, request: web.Request, prepared: Prepared | None = None) -> Generation:
        """The first choice's generation (APIs with one choice), or `prepared`'s."""
        gen = Generation(
            self.client,
            self.frontend,
            prepared or self.prepared,
            self.trace,
            source=self.served,
            replay_limit=request.app[SETTINGS].replay_limit,
            replay_timeout_s=max(1.0, remaining(self.deadline)),
        )
        state(request).generation = gen
        return gen

    def all_choices(self, request: web.Request) -> Choices:
        """Every choice's generation, driven as one (they share the Trace)."""
        # Prime requests share a prompt's prefill among its n rows (serving/choices);
        # only with a prefix cache to keep the state, and within the deadline.
        cache = request.app[SETTINGS].prefix_cache_bytes > 0
        prime_s = remaining(self.deadline) if cache and len(self.choices) > 1 else 0.0
        gens = Choices([self.generation(request, p) for p in self.choices], prime_s)
        state(request).generation = gens
        return gens

    def stream(self, first: bytes) -> SSEStream:
        """The stream's writer, its answer beginning with `first`, keep-alives running."""
        assert self.sse is not None
        trace = self.trace

        def first_byte() -> None:
            trace.first_byte = time.monotonic()

        self.sse.begin(first, first_byte)
        self.sse.keep_alive()
        return self.sse


@contextlib.asynccontextmanager
async def admitted(
    request: web.Request,
    model: str,
    stream: bool,
    body: ChatCompletionRequest | CompletionRequest,
) -> AsyncIterator[Admitted]:
    """Admission and preparation (module docstring). The in-flight slot and the lease are held
    until the block exits."""
    settings = request.app[SETTINGS]
    registry = request.app[MODELS]
    st = state(request)
    trace = st.trace = Trace(arrival=st.arrival)
    st.model, st.stream = model, stream
    hosted = registry.resolve(model)
    deadline = trace.arrival + settings.request_timeout_s
    try:
        # Before tokenization (and before a stopped model starts): a full queue
        # costs the server nothing more.
        ticket = hosted.admission.enter()
    except APIError:
        st.rejected = "queue_full"
        raise
    sse = st.sse = SSEStream(request, settings.sse_keepalive_s) if stream else None
    if sse is not None and (hosted.served is None or not hosted.served.ready.is_set()):
        sse.keep_alive(KEEPALIVE_STARTING)  # model loads take seconds to minutes
    try:
        async with registry.lease(hosted, deadline) as served:
            try:
                client = await served.acquire_client(remaining(deadline))
            finally:
                if sse is not None:
                    await sse.stopped()
            frontend = served.frontend
            assert frontend is not None
            with served.arrivals.preparing():
                choices = await _prepare(request, body, hosted, frontend, client)
            trace.tokenized = time.monotonic()
            await _wait_for_slot(request, ticket, deadline)
            # The worker may have been replaced while this request waited.
            client = await served.acquire_client(remaining(deadline))
            # A wave reaching an idle worker goes in together (serving/arrivals).
            await served.arrivals.pass_through(worker_idle=client.active == 0)
            frontend = served.frontend or frontend
            yield Admitted(client, frontend, choices[0], trace, deadline, served, sse, choices)
    finally:
        ticket.release()


async def _prepare(
    request: web.Request,
    body: ChatCompletionRequest | CompletionRequest,
    hosted: HostedModel,
    frontend: Frontend,
    client: WorkerClient,
) -> list[Prepared]:
    """Every choice, prepared (n > 1 and prompt lists: serving/choices)."""
    choices = await prepare_choices(
        with_profile(body, hosted),
        frontend,
        request.app[SETTINGS],
        client.ready.context_length,
        state(request).request_id,
        vocab_size=client.ready.vocab_size,
    )
    st = state(request)
    st.prompt_tokens, st.max_tokens = len(choices[0].prompt), choices[0].max_tokens
    return choices


async def _wait_for_slot(request: web.Request, ticket: Ticket, deadline: float) -> None:
    try:
        async with asyncio.timeout(remaining(deadline)):
            await ticket.acquire()
    except TimeoutError:
        raise timeout_error(request) from None
    except asyncio.CancelledError:
        state(request).cancelled_at = time.monotonic()
        raise
    state(request).admitted_at = ticket.admitted_at


async def early_failure(
    request: web.Request, e: APIError, event: bytes
) -> web.StreamResponse | None:
    """End a stream that keep-alives already began with the API's error `event`.

    None when nothing was sent yet: the caller answers with a plain HTTP error.
    """
    st = state(request)
    if st.sse is None or not await st.sse.fail_early(event):
        return None
    st.error = e.message
    return st.sse.resp


async def collect(
    request: web.Request, gen: Generation | Choices, *, model: str, deadline: float
) -> list[Chunk]:
    """A non-streaming answer's chunks: the whole generation within the deadline,
    started over if it is replayed on a new worker; a failed generation is an APIError."""
    chunks: list[Chunk] = []
    metrics = request.app[METRICS]
    clock = metrics.token_clock(model)
    async with gen:
        try:
            async with asyncio.timeout(remaining(deadline)):
                async for c in gen.chunks():
                    if c.reset:  # replayed on a new worker: that choice starts over
                        chunks[:] = [x for x in chunks if x.index != c.index]
                        clock = metrics.token_clock(model)
                        continue
                    chunks.append(c)
                    clock.tick(len(c.token_ids), time.monotonic())
        except TimeoutError:
            gen.finish_reason = "timeout"  # set before leaving: __aexit__ keeps it
            raise timeout_error(request) from None
        except asyncio.CancelledError:
            state(request).cancelled_at = time.monotonic()
            raise
    if gen.finish_reason == "error":
        raise generation_failed(gen.error)
    return chunks


async def pump(
    request: web.Request,
    gen: Generation | Choices,
    out: SSEStream,
    *,
    model: str,
    deadline: float,
    render: Callable[[Chunk], bytes],
    error_event: Callable[[APIError], bytes],
) -> bool:
    """Write a stream's chunks, each as `render` makes it, until the generation ends.

    A failure before any byte left is a plain HTTP error (raised); after, it is
    the API's `error_event`, and the result is False. True when the generation
    ended on its own.
    """
    metrics = request.app[METRICS]
    clock = metrics.token_clock(model)
    try:
        async with asyncio.timeout(remaining(deadline)):
            async for c in gen.chunks():
                if c.reset:  # replayed before any byte left: nothing to undo
                    clock = metrics.token_clock(model)
                    continue
                clock.tick(len(c.token_ids), time.monotonic())
                data = render(c)
                if data:
                    await out.write(data)
                if c.finish_reason == "error":
                    raise generation_failed(c.error)
    except APIError as e:
        if not out.started:
            raise  # nothing sent yet: a plain HTTP error
        # Headers are gone already: the error travels as an SSE event.
        state(request).error = e.message
        await out.write(error_event(e))
        return False
    except TimeoutError:
        gen.finish_reason = "timeout"  # set before leaving: __aexit__ keeps it
        timeout = timeout_error(request)
        if not out.started:
            raise timeout from None
        state(request).error = timeout.message
        await out.write(error_event(timeout))
        return False
    except asyncio.CancelledError:
        state(request).cancelled_at = time.monotonic()
        raise
    finally:
        out.stop()
    return True
