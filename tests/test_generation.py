"""The Generation object (gateway/serving/generation.py) against a scripted worker.

A real WorkerClient over a real socket pair; the other end speaks the real
protocol (protocol/transport.py) but its outputs are scripted, so each test
decides exactly which tokens arrive in which step. What a Generation owns is
checked: text and finish reasons, stop strings ending a request early (with an
Abort to the worker), and leaving the block early aborting it exactly once.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.config import Settings
from gateway.serving.generation import Generation, Prepared, Trace, prepare
from gateway.serving.requests import CompletionRequest
from gateway.serving.tokenizer import Frontend
from gateway.workers.client import WorkerClient
from protocol.messages import Abort, Add, Message, Ready, RequestOutput, StepOutputs, encode_message
from protocol.transport import read_message_async

EPOCH = 1


@pytest.fixture(scope="module")
def frontend(tiny_model_dir: Path) -> Iterator[Frontend]:
    f = Frontend(str(tiny_model_dir), eos_token_ids=[2], threads=1)
    yield f
    f.close()


class ScriptedWorker:
    """The worker's end of the socket: records what it is sent, sends what it is told."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.step = 0

    async def receive(self) -> Message:
        msg = await asyncio.wait_for(read_message_async(self.reader), 30)
        assert msg is not None
        return msg

    def emit(self, request_id: str, token_ids: list[int], finish: str | None = None) -> None:
        self.step += 1
        out = RequestOutput(request_id, token_ids, finish)
        self.writer.write(encode_message(StepOutputs(EPOCH, self.step, [out])))


@pytest.fixture
async def pair() -> AsyncIterator[tuple[WorkerClient, ScriptedWorker]]:
    a, b = socket.socketpair()
    gw_reader, gw_writer = await asyncio.open_connection(sock=a)
    w_reader, w_writer = await asyncio.open_connection(sock=b)
    ready = Ready(EPOCH, "tiny", "/tiny", "id", 2048, 8, 1, 0, "cpu", "none", [2], 1)
    client = WorkerClient(gw_reader, gw_writer, ready)
    yield client, ScriptedWorker(w_reader, w_writer)
    await client.close()
    w_writer.close()


async def _prepared(frontend: Frontend, request_id: str, **body: object) -> Prepared:
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": [5, 6, 7], **body})
    return await prepare(req, frontend, Settings(), 2048, request_id)


async def test_text_and_finish_reason_follow_the_workers_steps(
    frontend: Frontend, pair: tuple[WorkerClient, ScriptedWorker]
) -> None:
    client, worker = pair
    prepared = await _prepared(frontend, "r1", max_tokens=16)
    ids = frontend._encode("The answer is here")
    gen = Generation(client, frontend, prepared, Trace(arrival=time.monotonic()))
    async with gen:
        add = await worker.receive()
        assert isinstance(add, Add) and add.request_id == "r1" and add.prompt == [5, 6, 7]
        worker.emit("r1", ids[:2])
        worker.emit("r1", ids[2:], finish="length")
        chunks = [c async for c in gen.chunks()]
    assert "".join(c.text for c in chunks) == "The answer is here"
    assert [t for c in chunks for t in c.token_ids] == ids
    assert (gen.finish_reason, gen.completion_tokens) == ("length", len(ids))
    assert chunks[-1].finish_reason == "length"
    assert gen.trace.first_token is not None and gen.trace.retired is not None


async def test_a_stop_string_ends_the_request_and_aborts_it_in_the_worker(
    frontend: Frontend, pair: tuple[WorkerClient, ScriptedWorker]
) -> None:
    client, worker = pair
    prepared = await _prepared(frontend, "r2", max_tokens=16, stop=["STOP"])
    ids = frontend._encode("The answer is STOP and more")
    gen = Generation(client, frontend, prepared, Trace(arrival=time.monotonic()))
    async with gen:
        await worker.receive()  # the Add
        worker.emit("r2", ids)  # not finished: the worker would go on
        chunks = [c async for c in gen.chunks()]
        abort = await worker.receive()
    assert isinstance(abort, Abort) and abort.request_ids == ["r2"]
    assert "".join(c.text for c in chunks) == "The answer is "
    assert gen.finish_reason == "stop" and gen.text.matched == "STOP"


async def test_leaving_early_aborts_the_request_exactly_once(
    frontend: Frontend, pair: tuple[WorkerClient, ScriptedWorker]
) -> None:
    client, worker = pair
    prepared = await _prepared(frontend, "r3", max_tokens=16)
    gen = Generation(client, frontend, prepared, Trace(arrival=time.monotonic()))
    async with gen:  # the client went away before any token
        await worker.receive()
    assert gen.finish_reason == "abort"
    abort = await worker.receive()
    assert isinstance(abort, Abort) and abort.request_ids == ["r3"]
    # Exactly once: a second abort of the retired request sends nothing, so the
    # next frame the worker reads is the next request's Add.
    client.abort("r3")
    client.add((await _prepared(frontend, "r4", max_tokens=4)).add)
    after = await worker.receive()
    assert isinstance(after, Add) and after.request_id == "r4"
