"""protocol: the wire contract between the gateway and a worker (stdlib + msgpack only).

- ``protocol.frames`` owns the framing: the 12-byte header and ``ProtocolError``.
- ``protocol.messages`` owns the typed messages and the body codec: one encoder and
  one validating decoder, both pure functions safe from any thread.
- ``protocol.transport`` reads and writes whole messages over sockets: the
  blocking ``FrameReader`` (one thread at a time) and the asyncio reader/writer.
- ``protocol.worker_config`` is the worker's launch contract (flags, environment).

Nothing here imports aiohttp or mlx, so both processes can import it cheaply.
See docs/protocol.md for the handshake, directions and versioning rules.
"""

from protocol.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ProtocolError,
    pack_frame,
    parse_header,
)
from protocol.messages import (
    GATEWAY_TO_WORKER,
    MESSAGE_TYPES,
    WORKER_TO_GATEWAY,
    Abort,
    Add,
    Dead,
    Failed,
    Heartbeat,
    Hello,
    Message,
    Ready,
    RequestOutput,
    SamplingParams,
    Shutdown,
    StepOutputs,
    Utility,
    UtilityResult,
    decode_body,
    encode_message,
    expect,
)
from protocol.transport import FrameReader, read_message_async, write_message

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "GATEWAY_TO_WORKER",
    "HEADER",
    "MAGIC",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "WORKER_TO_GATEWAY",
    "Abort",
    "Add",
    "Dead",
    "Failed",
    "FrameReader",
    "Heartbeat",
    "Hello",
    "Message",
    "ProtocolError",
    "Ready",
    "RequestOutput",
    "SamplingParams",
    "Shutdown",
    "StepOutputs",
    "Utility",
    "UtilityResult",
    "decode_body",
    "encode_message",
    "expect",
    "pack_frame",
    "parse_header",
    "read_message_async",
    "write_message",
]
