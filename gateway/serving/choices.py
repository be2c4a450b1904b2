"""Several choices in one request: `n > 1`, and /v1/completions with a list of prompts.

Owns how one API request maps onto worker requests (docs/api.md#n-and-prompt-lists):
- `prepare_choices` prepares every prompt once and copies it `n` times, so
  choice `p * n + i` is prompt `p`'s i-th sample (OpenAI's index order). Each
  copy is its own worker request (id `<request id>-<k>`, choice 0 keeping the
  request's id) with the same prompt ids: submitted together, the worker's
  prefix cache and batching share the prompt's work. With a `seed`, choice
  `k` samples with `derive_seed(seed, k)` (choice 0 with the seed itself), so
  the choices are reproducible and distinct.
- Prefix sharing: the worker's prefix cache receives a prompt's KV state when a
  request finishes, so n rows submitted at once would each prefill the whole
  prompt. With the prefix cache on and a prompt of at least `PRIME_MIN_TOKENS`
  sampled more than once, `Choices` first runs a one-token "prime" request for
  that prompt (id `<choice 0's id>-prime`); when it finishes, the prompt's state
  is in the cache and every row prefills only its last token. The cost is one
  short request before the rows start; a failed prime only loses the sharing.
- `Choices` runs them as one unit: entered together (submitted back to back),
  left together (every unfinished row is aborted: a disconnect cancels them
  all), iterated as one stream of `Chunk`s tagged with their choice `index`.
  Each row replays on a worker restart on its own terms (gateway/serving/generation):
  while no byte has reached the client; they share one Trace, so after the
  first byte none does.
- usage as OpenAI counts it: each distinct prompt's tokens once, completion
  tokens summed over the choices.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from gateway.serving.generation import Chunk, Generation, Prepared, prepare
from gateway.serving.requests import ChatCompletionRequest, CompletionRequest
from gateway.workers.client import MessageTooLarge, WorkerClient, WorkerUnavailable

# Shorter prompts are cheaper to prefill n times than to wait for a prime request.
PRIME_MIN_TOKENS = 32


def derive_seed(seed: int, k: int) -> int:
    """Choice k's seed: the request's seed for k = 0, else a hash of (seed, k)."""
    if k == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # < 2**63: any worker accepts it


def _copy(prepared: Prepared, request_id: str, k: int) -> Prepared:
    """Prepared for choice k (k > 0) of the same prompt: own id, own seed."""
    sampling = prepared.add.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=derive_seed(sampling.seed, k))
    add = dataclasses.replace(prepared.add, request_id=request_id, sampling=sampling)
    return Prepared(
        request_id,
        prepared.prompt,
        prepared.max_tokens,
        prepared.stops,
        add,
        prepared.top_logprobs,
        prepared.output,
        prepared.prompt_text,
    )


async def prepare_choices(
    body: ChatCompletionRequest | CompletionRequest, *args: Any, **kwargs: Any
) -> list[Prepared]:
    """Every choice of the request, in index order (arguments as `prepare`'s).

    Every prompt is prepared (and checked against the limits) before anything
    is submitted, so a bad prompt in a list is a 400 for the whole request.
    """
    request_id = args[3] if len(args) > 3 else kwargs["request_id"]
    if isinstance(body, CompletionRequest) and len(body.prompt_inputs()) > 1:
        bodies: list[ChatCompletionRequest | CompletionRequest] = [
            body.model_copy(update={"prompt": p}) for p in body.prompt_inputs()
        ]
    else:
        bodies = [body]
    out: list[Prepared] = []
    for b in bodies:
        first = await prepare(b, *args, **kwargs)
        for _ in range(body.n):
            k = len(out)
            out.append(first if k == 0 else _copy(first, f"{request_id}-{k}", k))
    return out


async def _prime_one(client: WorkerClient, prepared: Prepared) -> None:
    """One token of `prepared`'s prompt, no logprobs or grammar: its KV state stays cached."""
    add = dataclasses.replace(
        prepared.add,
        request_id=prepared.request_id + "-prime",
        max_tokens=1,
        logprobs=False,
        top_logprobs=0,
        constraint="",
    )
    try:
        stream = client.add(add)
        while (await stream.next()).finish_reason is None:
            pass
    except (WorkerUnavailable, MessageTooLarge):
        return  # the rows will find out (replay, or the 400 of an Add over the frame limit)
    finally:
        client.abort(add.request_id)  # no-op once it finished; frees it if cancelled


class Choices:
    """The generations of one request's choices, driven as one (see the module doc).

    Quacks like a `Generation` for the shared driver (collect/pump, the request
    record): `chunks()`, `finish_reason`, `error`, `completion_tokens`,
    `cached_tokens`, `trace`.
    """

    def __init__(self, gens: list[Generation], prime_timeout_s: float = 0.0) -> None:
        assert gens
        self.gens = gens
        self.trace = gens[0].trace
        self.prepared = gens[0].prepared
        self.prime_timeout_s = prime_timeout_s  # 0: no prime requests (no prefix cache)

    async def __aenter__(self) -> Choices:
        if self.prime_timeout_s > 0:
            await self._prime()
        entered: list[Generation] = []
        try:
            for g in self.gens:
                await g.__aenter__()  # an Add over the worker's frame limit: a 400
                entered.append(g)
        except BaseException as e:
            for g in entered:  # abort the rows already submitted
                await g.__aexit__(type(e), e, e.__traceback__)
            raise
        return self

    async def _prime(self) -> None:
        """Put each prompt sampled more than once into the worker's prefix cache."""
        shared = [
            p
            for p in self._firsts()
            if len(p.prompt) >= PRIME_MIN_TOKENS
            and sum(g.prepared.prompt is p.prompt for g in self.gens) > 1
        ]
        if not shared:
            return
        client = self.gens[0].client
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.prime_timeout_s):
                await asyncio.gather(*(_prime_one(client, p) for p in shared))

    async def __aexit__(self, *exc: Any) -> None:
        for g in self.gens:
            await g.__aexit__(*exc)

    @property
    def finish_reason(self) -> str | None:
        reasons = [g.finish_reason for g in self.gens]
        if "error" in reasons:
            return "error"
        return None if None in reasons else reasons[0]

    @finish_reason.setter
    def finish_reason(self, reason: str | None) -> None:
        # A timeout (set before leaving) or a slow reader (set after leaving, over
        # the "abort" that __aexit__ gave the unfinished rows) ends every choice
        # that was still running; finished ones keep their own reason.
        for g in self.gens:
            if g.finish_reason in (None, "abort"):
                g.finish_reason = reason

    @property
    def error(self) -> str:
        return next((g.error for g in self.gens if g.error), "")

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.gens)

    def prompt_tokens(self) -> int:
        """Each distinct prompt once (OpenAI's usage for n > 1)."""
        return sum(len(p.prompt) for p in self._firsts())

    @property
    def cached_tokens(self) -> int:
        firsts = {id(p) for p in self._firsts()}
        return sum(g.cached_tokens for g in self.gens if id(g.prepared) in firsts)

    def _firsts(self) -> list[Prepared]:
        """The first choice's Prepared of each prompt (copies share the prompt list)."""
        seen: dict[int, Prepared] = {}
        for g in self.gens:
            seen.setdefault(id(g.prepared.prompt), g.prepared)
        return list(seen.values())

    async def chunks(self) -> AsyncIterator[Chunk]:
        if len(self.gens) == 1:
            async for c in self.gens[0].chunks():
                yield c
            return
        iters = [g.chunks().__aiter__() for g in self.gens]
        pending = {asyncio.ensure_future(anext(it)): k for k, it in enumerate(iters)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=pending.__getitem__):
                    k = pending.pop(fut)
                    try:
                        c = fut.result()
                    except StopAsyncIteration:
                        continue
                    c.index = k
                    pending[asyncio.ensure_future(anext(iters[k]))] = k
                    yield c
        finally:
            for fut in pending:
                fut.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
