"""Frames: the fixed header around every message body, and blocking/async frame IO.

This module owns the wire framing between the gateway and a worker. A frame is a
12-byte header followed by a msgpack body (see ``protocol.messages``)::

    magic  b"MLXD"   4 bytes
    version          u8   PROTOCOL_VERSION
    message type     u8   a message class's TYPE
    flags            u16  reserved: must be 0 in protocol version 1
    body length      u32  bytes that follow; at most the reader's max_frame_bytes

All integers are big-endian. A reader checks magic, version, flags and the length
against its limit before it reads (or allocates) the body, so a hostile or
confused peer cannot make it allocate more than ``max_frame_bytes``.

Errors: every malformed input (bad header, EOF inside a frame, an invalid body)
raises ``ProtocolError``; the caller closes that connection and logs the reason.
A clean EOF exactly at a frame boundary is not an error: the readers return None.
Transport errors of the socket itself (``OSError``: reset, timeout) propagate
unchanged.

Threading: ``pack_frame``/``parse_header`` are pure. A ``FrameReader`` is used by
one thread at a time, over a blocking socket without a timeout (a timeout in the
middle of a frame would lose the bytes already read; to stop a reader, shut the
socket down). ``write_message`` calls ``sendall`` once per message; when several
threads write to one socket they must serialize their calls (one writer thread or
a lock), or frames interleave.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from protocol.messages import Message

MAGIC: Final = b"MLXD"
PROTOCOL_VERSION: Final = 1
HEADER: Final = struct.Struct(">4sBBHI")  # magic, version, message type, flags, body length
DEFAULT_MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
KNOWN_FLAGS: Final = 0  # no flag bits are defined in protocol version 1

_MAX_BODY: Final = 0xFFFF_FFFF


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame or message: close the connection."""


def pack_frame(msg_type: int, body: bytes, flags: int = 0) -> bytes:
    """One frame: header + body. Raises ProtocolError for out-of-range header fields."""
    if not 0 <= msg_type <= 0xFF:
        raise ProtocolError(f"message type {msg_type} does not fit in a u8")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"flags {flags:#x} are not defined in protocol {PROTOCOL_VERSION}")
    if len(body) > _MAX_BODY:
        raise ProtocolError(f"body of {len(body)} bytes does not fit in a u32 length")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, flags, len(body)) + body


def parse_header(header: bytes | bytearray, max_frame_bytes: int) -> tuple[int, int, int]:
    """Check a 12-byte header and return (message type, flags, body length)."""
    if len(header) != HEADER.size:
        raise ProtocolError(f"header is {len(header)} bytes, expected {HEADER.size}")
    magic, version, msg_type, flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"unknown flags {flags:#06x}")
    if length > max_frame_bytes:
        raise ProtocolError(f"frame body of {length} bytes exceeds the limit of {max_frame_bytes}")
    return msg_type, flags, length


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
        return _messages.decode_body(msg_type, body, self._max_frame_bytes)

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
    return _messages.decode_body(msg_type, body, max_frame_bytes)


def write_message(sock: socket.socket, msg: Message) -> None:
    """Send one message as one frame (blocking sendall; serialize concurrent writers)."""
    sock.sendall(_messages.encode_message(msg))


# messages builds on the header code above, and the readers above decode through it: import
# it last, as a module, so this cycle resolves whichever of the two is imported first.
from protocol import messages as _messages  # noqa: E402
