"""Message I/O over sockets: whole frames in, typed messages out, and back.

Built on protocol/frames.py (the header) and protocol/messages.py (the body codec),
which do not import this module: the protocol's modules form no cycle.

Errors: every malformed input (bad header, EOF inside a frame, an invalid body)
raises ``ProtocolError``; a clean EOF exactly at a frame boundary returns None;
transport errors of the socket itself (``OSError``) propagate unchanged.

Threading: a ``FrameReader`` is used by one thread at a time, over a blocking
socket without a timeout (a timeout in the middle of a frame would lose the bytes
already read; to stop a reader, shut the socket down). ``write_message`` calls
``sendall`` once per message; when several threads write to one socket they must
serialize their calls (one writer thread or a lock), or frames interleave.
``read_message_async`` runs on the event loop that owns its StreamReader.
"""

from __future__ import annotations

import asyncio
import socket

from protocol.frames import DEFAULT_MAX_FRAME_BYTES, HEADER, ProtocolError, parse_header
from protocol.messages import Message, decode_body, encode_message


class FrameReader:
    """Reads whole messages from a connected blocking socket (one thread at a time)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self._max_frame_bytes = max_frame_bytes
        self._header = bytearray(HEADER.size)

    def read_message(self) -> Message | None:
        """The next message; None on a clean EOF between frames; ProtocolError otherwise."""
        if not self._fill(self._header, at_boundary=True):
            return None
        msg_type, _flags, length = parse_header(self._header, self._max_frame_bytes)
        body = bytearray(length)
        self._fill(body, at_boundary=False)
        return decode_body(msg_type, body, self._max_frame_bytes)

    def _fill(self, buf: bytearray, *, at_boundary: bool) -> bool:
        """Fill buf completely; False only on EOF before its first byte at a frame boundary."""
        view = memoryview(buf)
        got, size = 0, len(buf)
        while got < size:
            n = self._sock.recv_into(view[got:], size - got)
            if n == 0:
                if got == 0 and at_boundary:
                    return False
                what = "header" if at_boundary else "body"
                raise ProtocolError(f"connection closed inside a frame {what} ({got}/{size} bytes)")
            got += n
        return True


async def read_message_async(
    reader: asyncio.StreamReader, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Message | None:
    """The next message from a StreamReader; same semantics as FrameReader.read_message."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError(
            f"connection closed inside a frame header ({len(e.partial)}/{HEADER.size} bytes)"
        ) from None
    msg_type, _flags, length = parse_header(header, max_frame_bytes)
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(
            f"connection closed inside a frame body ({len(e.partial)}/{length} bytes)"
        ) from None
    return decode_body(msg_type, body, max_frame_bytes)


def write_message(sock: socket.socket, msg: Message) -> None:
    """Send one message as one frame (blocking sendall; serialize concurrent writers)."""
    sock.sendall(encode_message(msg))
