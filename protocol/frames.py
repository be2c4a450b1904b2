"""Frames: the fixed header around every message body.

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

Reading and writing whole messages over sockets is protocol/transport.py's;
this module imports nothing of the protocol's, so messages and transport build on it.

Threading: everything here is pure.
"""

from __future__ import annotations

import struct
from typing import Final

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
