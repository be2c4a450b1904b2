"""Property tests over whole frame streams (tests/test_protocol.py covers single bodies).

A stream is a sequence of pieces: valid frames, mutated frames, truncated frames
and random bytes, delivered in random fragments. Both readers (the worker's
blocking FrameReader, the gateway's async reader) must decode every leading
valid frame exactly, then end with a clean EOF or a ProtocolError: never
another exception, never a hang, never a body read past the frame limit.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER,
    Abort,
    Add,
    FrameReader,
    Heartbeat,
    Hello,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    Utility,
    encode_message,
    read_message_async,
)

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

MESSAGES = [
    Hello(1, 3, "token"),
    Add("r1", [1, 2, 3], 8, SamplingParams(temperature=0.5, logit_bias={"7": -1.0})),
    Abort(["r1", "r2"]),
    Utility(9, "stats", {"since": 1.5}),
    Heartbeat(3, 10, 2, 1, 123, 0.5),
    StepOutputs(3, 11, [RequestOutput("r1", [4, 5], "length", logprobs=[-0.1, -0.2])]),
]
FRAMES = [encode_message(m) for m in MESSAGES]


@st.composite
def piece(draw: Any) -> tuple[str, bytes, int]:
    """(kind, bytes, index of the message for a valid frame else -1)."""
    kind = draw(st.sampled_from(["valid", "valid", "mutated", "truncated", "random"]))
    i = draw(st.integers(0, len(FRAMES) - 1))
    frame = FRAMES[i]
    if kind == "valid":
        return kind, frame, i
    if kind == "truncated":
        return kind, frame[: draw(st.integers(1, len(frame) - 1))], -1
    if kind == "random":
        return kind, draw(st.binary(min_size=1, max_size=48)), -1
    at = draw(st.integers(0, len(frame) - 1))
    flip = draw(st.integers(1, 255))
    return kind, frame[:at] + bytes([frame[at] ^ flip]) + frame[at + 1 :], -1


def _expected_prefix(pieces: list[tuple[str, bytes, int]], limit: int) -> list[Any]:
    """The messages of the leading valid frames that fit the limit."""
    out = []
    for kind, data, i in pieces:
        if kind != "valid" or len(data) - HEADER.size > limit:
            break
        out.append(MESSAGES[i])
    return out


async def _read_async(data: bytes, limit: int) -> tuple[list[Any], str]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    out: list[Any] = []
    try:
        while (msg := await asyncio.wait_for(read_message_async(reader, limit), 5)) is not None:
            out.append(msg)
    except ProtocolError:
        return out, "protocol error"
    return out, "eof"


def _read_blocking(data: bytes, limit: int, cuts: list[int]) -> tuple[list[Any], str]:
    a, b = socket.socketpair()
    b.settimeout(5)  # a reader waiting for bytes never sent would fail with TimeoutError

    def send() -> None:
        with a:
            start = 0
            for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
                if cut > start:
                    a.sendall(data[start:cut])
                    start = cut
            a.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    out: list[Any] = []
    end = "eof"
    try:
        reader = FrameReader(b, limit)
        while (msg := reader.read_message()) is not None:
            out.append(msg)
    except ProtocolError:
        end = "protocol error"
    finally:
        sender.join()
        b.close()
    return out, end


LIMITS = st.sampled_from([16, 64, 256, DEFAULT_MAX_FRAME_BYTES])


def test_async_reader_over_random_streams() -> None:
    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.lists(piece(), max_size=6), LIMITS)
    def check(pieces: list[tuple[str, bytes, int]], limit: int) -> None:
        data = b"".join(p[1] for p in pieces)
        out, end = asyncio.run(_read_async(data, limit))
        expected = _expected_prefix(pieces, limit)
        assert out[: len(expected)] == expected
        if len(expected) == len(pieces):
            assert out == expected and end == "eof"

    check()


def test_blocking_reader_over_random_fragmented_streams() -> None:
    @hypothesis.settings(max_examples=150, deadline=None)
    @hypothesis.given(
        st.lists(piece(), max_size=5), LIMITS, st.lists(st.integers(0, 10_000), max_size=8)
    )
    def check(pieces: list[tuple[str, bytes, int]], limit: int, cuts: list[int]) -> None:
        data = b"".join(p[1] for p in pieces)
        out, end = _read_blocking(data, limit, cuts)
        expected = _expected_prefix(pieces, limit)
        assert out[: len(expected)] == expected
        if len(expected) == len(pieces):
            assert out == expected and end == "eof"

    check()
