"""The gateway <-> worker wire protocol: golden bytes, round trips, compatibility, bad input."""

import asyncio
import dataclasses
import socket
import subprocess
import sys
import threading
import typing
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest

from protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    GATEWAY_TO_WORKER,
    HEADER,
    MAGIC,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    WORKER_TO_GATEWAY,
    Abort,
    Add,
    Dead,
    Failed,
    FrameReader,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
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
    pack_frame,
    parse_header,
    read_message_async,
    write_message,
)

STEP = StepOutputs(
    epoch=3,
    step=42,
    outputs=[
        RequestOutput(
            request_id="r1",
            token_ids=[5, 300],
            finish_reason="stop",
            logprobs=[-0.5, -1.25],
            top_logprobs=[[[5.0, -0.5]], [[300.0, -1.25], [7.0, -2.0]]],
            cached_tokens=4,
        )
    ],
    stats={"active": 1},
)

# One of every message, with non-default values, nested structs and None-able fields set.
SAMPLES: list[Message] = [
    Hello(1, 7, "tok"),
    Ready(
        epoch=7,
        model_id="smollm2",
        model_path="/models/smollm2",
        identity="sha256:abc",
        context_length=8192,
        max_batch=32,
        kv_bytes_per_token=36864,
        memory_budget=2**33,
        backend="cpu",
        blas="openblas",
        eos_token_ids=[2, 0],
        pid=1234,
        load_time_s=1.5,
    ),
    Failed("model failed to load", 77),
    Add(
        request_id="req-1",
        prompt=[1, 2, 3, 2**40],
        max_tokens=16,
        sampling=SamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=2**63 - 1,
            presence_penalty=0.1,
            frequency_penalty=-0.2,
            repetition_penalty=1.1,
            logit_bias={"50256": -100.0, "7": 2.5},
        ),
        stop_token_ids=[2],
        priority=-1,
        logprobs=True,
        top_logprobs=5,
    ),
    Abort(["a", "req-2"]),
    Utility(9, "stats", {"verbose": True, "depth": [1, 2.5, None, "x", b"\x00"], "n": {"k": {}}}),
    UtilityResult(9, False, {"x": -1}, "no such method"),
    Shutdown(),
    STEP,
    Heartbeat(epoch=3, step=42, active=2, queued=0, monotonic_ns=2**63 + 5),
    Dead("engine crashed", 1),
    # defaults and None-able fields left empty
    Add("req-2", [], 1, SamplingParams()),
    StepOutputs(1, 0, [RequestOutput("r", [1]), RequestOutput("s", [], error="boom")]),
    Utility(1, "drain"),
    UtilityResult(1, True),
]


def body_of(msg: Message) -> bytes:
    return encode_message(msg)[HEADER.size :]


def header(msg_type: int = Hello.TYPE, length: int = 0, **fields: Any) -> bytes:
    values = {"magic": MAGIC, "version": PROTOCOL_VERSION, "flags": 0} | fields
    return HEADER.pack(values["magic"], values["version"], msg_type, values["flags"], length)


# --------------------------------------------------------------------------------- golden bytes


@pytest.mark.parametrize(
    ("msg", "golden"),
    [
        (Hello(1, 7, "tok"), "4d4c5844 01 01 0000 00000007 930107a3746f6b"),
        (Abort(["a", "req-2"]), "4d4c5844 01 05 0000 0000000a 9192a161a57265712d32"),
        (
            STEP,
            # the trailing default fields of the RequestOutput (error "" and later
            # additions) are left off the wire: a 6-element array
            "4d4c5844 01 09 0000 0000006b "
            "94032a9196a272319205cd012ca473746f7092cbbfe0000000000000cbbff4000000000000929192cb"
            "4014000000000000cbbfe00000000000009292cb4072c00000000000cbbff400000000000092cb401c"
            "000000000000cbc0000000000000000481a661637469766501",
        ),
        (Shutdown(), "4d4c5844 01 08 0000 00000001 90"),
    ],
    ids=["hello", "abort", "step_outputs", "shutdown"],
)
def test_golden_bytes(msg: Message, golden: str) -> None:
    assert encode_message(msg) == bytes.fromhex(golden)


def test_imports_neither_aiohttp_nor_mlx() -> None:
    code = "import sys, protocol; print(sorted({'aiohttp', 'mlx'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_type_ids_never_change() -> None:
    assert {cls.__name__: t for t, cls in MESSAGE_TYPES.items()} == {
        "Hello": 1,
        "Ready": 2,
        "Failed": 3,
        "Add": 4,
        "Abort": 5,
        "Utility": 6,
        "UtilityResult": 7,
        "Shutdown": 8,
        "StepOutputs": 9,
        "Heartbeat": 10,
        "Dead": 11,
    }


# ----------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    frame = encode_message(msg)
    msg_type, flags, length = parse_header(frame[: HEADER.size], DEFAULT_MAX_FRAME_BYTES)
    assert (msg_type, flags, length) == (msg.TYPE, 0, len(frame) - HEADER.size)
    decoded = decode_body(msg_type, frame[HEADER.size :])
    assert decoded == msg
    assert type(decoded) is type(msg)
    for f in dataclasses.fields(decoded):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(decoded, f.name, None)


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


def test_decoded_values_have_exact_types() -> None:
    add = decode_body(Add.TYPE, msgpack.packb(["r", [1], 5, [1, 1, 0, 0, None, 0, 0, 1, {"3": 2}]]))
    assert isinstance(add, Add)
    assert type(add.sampling.temperature) is float  # an int on the wire becomes a float
    assert type(add.sampling.logit_bias["3"]) is float
    step = _packed(1, 2, [["r", [300], None, [-1.25], [[[300, -1.25], [7, -2]]]]])
    [out] = typing.cast(StepOutputs, decode_body(StepOutputs.TYPE, step)).outputs
    assert out.top_logprobs == [[[300.0, -1.25], [7.0, -2.0]]]  # token ids come back as floats
    assert all(type(x) is float for pair in out.top_logprobs[0] for x in pair)


def test_directions() -> None:
    assert set(MESSAGE_TYPES.values()) == GATEWAY_TO_WORKER | WORKER_TO_GATEWAY
    assert not GATEWAY_TO_WORKER & WORKER_TO_GATEWAY
    hello = Hello(1, 0)
    assert expect(hello, GATEWAY_TO_WORKER) is hello
    with pytest.raises(ProtocolError, match="Hello"):
        expect(hello, WORKER_TO_GATEWAY)


# -------------------------------------------------------------------------------- compatibility


def test_missing_trailing_fields_take_defaults() -> None:
    assert decode_body(Hello.TYPE, msgpack.packb([1, 7])) == Hello(1, 7, "")
    add = decode_body(Add.TYPE, msgpack.packb(["r", [1, 2], 8, []]))
    assert add == Add("r", [1, 2], 8, SamplingParams(), [], 0, False, 0)
    again = decode_body(Add.TYPE, msgpack.packb(["r", [1, 2], 8, []]))
    assert isinstance(add, Add) and isinstance(again, Add)
    assert add.stop_token_ids is not again.stop_token_ids  # default_factory: fresh lists
    step = decode_body(StepOutputs.TYPE, msgpack.packb([1, 2, [["r", [9]]]]))
    assert step == StepOutputs(1, 2, [RequestOutput("r", [9])], {})


def test_extra_trailing_fields_are_ignored() -> None:
    newer = msgpack.packb([1, 7, "tok", "a field from the future", [1, 2]])
    assert decode_body(Hello.TYPE, newer) == Hello(1, 7, "tok")
    nested = [3, 42, [["r", [5], None, None, None, 0, "", 0.0, 0.0, {"new": 1}]], {}, 99]
    step = decode_body(StepOutputs.TYPE, msgpack.packb(nested))
    assert step == StepOutputs(3, 42, [RequestOutput("r", [5])])
    assert decode_body(Shutdown.TYPE, msgpack.packb([1, 2])) == Shutdown()


# ------------------------------------------------------------------------------ malformed bodies

_HELLO = Hello.TYPE
_ADD = Add.TYPE
_STEP = StepOutputs.TYPE
_SAMPLING: list[Any] = [1.0, 1.0, 0, 0.0, None, 0.0, 0.0, 1.0, {}]


def _packed(*value: Any) -> bytes:
    return msgpack.packb(list(value))


BAD_BODIES: dict[str, tuple[int, bytes]] = {
    "empty": (_HELLO, b""),
    "garbage msgpack": (_HELLO, b"\xc1\xc1\xc1"),
    "truncated msgpack": (_HELLO, b"\x93\x01"),
    "trailing bytes": (_HELLO, _packed(1, 7) + b"\x00"),
    "body is a map": (_HELLO, msgpack.packb({"protocol_version": 1, "epoch": 7})),
    "body is an int": (_HELLO, msgpack.packb(1)),
    "too few fields": (_HELLO, _packed(1)),
    "str for int": (_HELLO, _packed("1", 7)),
    "bool for int": (_HELLO, _packed(True, 7)),
    "float for int": (_HELLO, _packed(1.0, 7)),
    "None for int": (_HELLO, _packed(None, 7)),
    "bytes for str": (_HELLO, _packed(1, 7, b"tok")),
    "int for bool": (UtilityResult.TYPE, _packed(1, 1)),
    "str for float": (
        Ready.TYPE,
        _packed(1, "m", "p", "i", 1, 1, 1, 1, "cpu", "ref", [], 1, "1.0"),
    ),
    "list of str for list[int]": (_ADD, _packed("r", ["1", "2"], 8, _SAMPLING)),
    "one str for list[int]": (_ADD, _packed("r", ["1"], 8, _SAMPLING)),
    "bool in list[int]": (_ADD, _packed("r", [1, True], 8, _SAMPLING)),
    "int for list[int]": (_ADD, _packed("r", 1, 8, _SAMPLING)),
    "nested struct not a list": (_ADD, _packed("r", [1], 8, "greedy")),
    "nested struct wrong field": (_ADD, _packed("r", [1], 8, ["hot"])),
    "nested struct in list wrong": (_STEP, _packed(1, 2, [[7, [1]]])),
    "nested struct in list short": (_STEP, _packed(1, 2, [["r"]])),
    "logit_bias key not a token id": (_ADD, _packed("r", [1], 8, [*_SAMPLING[:8], {"a": 1.0}])),
    "logit_bias value str": (_ADD, _packed("r", [1], 8, [*_SAMPLING[:8], {"1": "x"}])),
    "top_logprobs str id": (_STEP, _packed(1, 2, [["r", [1], None, [0.0], [[["1", 0.0]]]]])),
    "top_logprobs flat": (_STEP, _packed(1, 2, [["r", [1], None, [0.0], [[1.0, 0.0]]]])),
    "logprobs str": (_STEP, _packed(1, 2, [["r", [1], None, ["x"]]])),
    "stats int keys": (_STEP, b"\x94\x01\x02\x90\x81\x01\x02"),
    "stats bytes keys": (_STEP, _packed(1, 2, [], {b"k": 1})),
    "args not a dict": (Utility.TYPE, _packed(1, "stats", [1])),
    "unknown type 0": (0, _packed()),
    "unknown type 12": (12, _packed()),
    "unknown type 255": (255, _packed()),
    "ext type": (Utility.TYPE, _packed(1, "m", {"x": msgpack.ExtType(5, b"xy")})),
    "timestamp ext": (Utility.TYPE, _packed(1, "m", {"x": msgpack.Timestamp(1, 0)})),
    "huge array length": (Abort.TYPE, b"\x91\xdd\xff\xff\xff\xff\xa1a"),
    "huge map length": (Utility.TYPE, b"\x93\x01\xa1m\xdf\x7f\xff\xff\xff"),
    "huge str length": (_HELLO, b"\x93\x01\x02\xdb\x7f\xff\xff\xff"),
    "huge bin length": (Utility.TYPE, b"\x93\x01\xa1m\x81\xa1x\xc6\x7f\xff\xff\xff"),
    "deep nesting": (Utility.TYPE, b"\x93\x01\xa1m\x81\xa1x" + b"\x91" * 5000 + b"\x90"),
    "invalid utf-8": (_HELLO, b"\x93\x01\x02\xa2\xff\xfe"),
}


@pytest.mark.parametrize(("msg_type", "body"), BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_body_is_a_protocol_error(msg_type: int, body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_body(msg_type, body)


def test_body_over_the_limit_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="limit"):
        decode_body(Abort.TYPE, body_of(Abort(["x" * 100])), max_frame_bytes=64)


def test_error_names_the_field() -> None:
    with pytest.raises(ProtocolError, match=r"StepOutputs\.outputs: RequestOutput\.token_ids"):
        decode_body(_STEP, _packed(1, 2, [["r", ["x"]]]))


@pytest.mark.parametrize(
    "msg",
    [
        Utility(1, "m", {"x": {1, 2}}),  # not msgpack-native
        Utility(1, "m", {"x": object()}),
        Heartbeat(1, 2, 3, 4, 2**64),  # beyond 64 bits
        Abort(["\ud800"]),  # lone surrogate: not UTF-8
        typing.cast(Message, SamplingParams()),  # a nested struct, not a message
    ],
    ids=["set", "object", "big int", "surrogate", "not a message"],
)
def test_unencodable_message_is_a_protocol_error(msg: Message) -> None:
    with pytest.raises(ProtocolError):
        encode_message(msg)


def test_pack_frame_checks_its_header_fields() -> None:
    for bad in [{"msg_type": 256}, {"msg_type": -1}, {"flags": 1}]:
        with pytest.raises(ProtocolError):
            pack_frame(**({"msg_type": 1, "body": b"\x90"} | bad))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        parse_header(header()[:-1], DEFAULT_MAX_FRAME_BYTES)


# -------------------------------------------------------------------- frame readers (both kinds)

Read = Callable[..., Awaitable[Message | None]]


async def _read_blocking(data: bytes, eof: bool = True, max_frame_bytes: int = 1 << 20) -> Any:
    a, b = socket.socketpair()
    with a, b:
        # A reader that waits for bytes never sent fails with TimeoutError, not ProtocolError.
        b.settimeout(5)
        a.sendall(data)
        if eof:
            a.shutdown(socket.SHUT_WR)
        reader = FrameReader(b, max_frame_bytes)
        return [reader.read_message(), reader.read_message()] if data else reader.read_message()


async def _read_async(data: bytes, eof: bool = True, max_frame_bytes: int = 1 << 20) -> Any:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()

    async def read() -> Message | None:
        return await asyncio.wait_for(read_message_async(reader, max_frame_bytes), 5)

    return [await read(), await read()] if data else await read()


@pytest.fixture(params=["blocking", "async"])
def read(request: pytest.FixtureRequest) -> Read:
    """Feed bytes (then EOF) to a reader; read up to two messages (one if no bytes)."""
    return typing.cast(Read, _read_blocking if request.param == "blocking" else _read_async)


async def test_clean_eof_at_a_boundary_is_none(read: Read) -> None:
    assert await read(b"") is None
    assert await read(encode_message(Hello(1, 7))) == [Hello(1, 7), None]
    assert await read(encode_message(Abort(["x"])) * 2) == [Abort(["x"])] * 2


_GOOD = encode_message(Hello(1, 7, "tok"))
BAD_FRAMES: dict[str, bytes] = {
    "truncated header": _GOOD[:5],
    "truncated body": _GOOD[:-2],
    "header only": _GOOD[: HEADER.size],
    "wrong magic": b"MLXX" + _GOOD[4:],
    "wrong version": header(Hello.TYPE, 7, version=2) + _GOOD[HEADER.size :],
    "unknown flags": header(Hello.TYPE, 7, flags=0x8000) + _GOOD[HEADER.size :],
    "unknown type": header(99, 7) + _GOOD[HEADER.size :],
    "garbage body": header(Hello.TYPE, 3) + b"\xc1\xc1\xc1",
    "good frame then truncated": _GOOD + _GOOD[:-1],
    "good frame then garbage": _GOOD + b"HTTP/1.1 200 OK\r\n",
}


@pytest.mark.parametrize("data", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
async def test_bad_frame_is_a_protocol_error(read: Read, data: bytes) -> None:
    with pytest.raises(ProtocolError):
        await read(data)


@pytest.mark.parametrize(("length", "limit"), [(65, 64), (0xFFFF_FFFF, DEFAULT_MAX_FRAME_BYTES)])
async def test_oversize_length_fails_before_the_body(read: Read, length: int, limit: int) -> None:
    # Only the header is sent and the connection stays open: a reader that tried to read
    # (or allocate) the body would wait, and time out instead of raising ProtocolError.
    # ProtocolError is the proof: a reader waiting for the body fails with TimeoutError.
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        await read(header(Abort.TYPE, length), eof=False, max_frame_bytes=limit)


def test_blocking_reader_reassembles_fragments_and_large_frames() -> None:
    big = Add("big", list(range(1_000_000)), 1, SamplingParams())  # about 5 MB
    messages: list[Message] = [Hello(1, 7, "tok"), big, STEP, Shutdown()]
    a, b = socket.socketpair()
    with a, b:

        def send() -> None:
            for byte in encode_message(messages[0]):  # one byte per send
                a.send(bytes([byte]))
            for msg in messages[1:]:
                write_message(a, msg)
            a.close()

        sender = threading.Thread(target=send)
        sender.start()
        reader = FrameReader(b)
        received = [reader.read_message() for _ in messages]
        assert reader.read_message() is None
        sender.join()
    assert received == messages


async def test_async_reader_over_a_real_socket() -> None:
    a, b = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=b)
    try:
        with a:
            for msg in SAMPLES:
                write_message(a, msg)
        for msg in SAMPLES:
            assert await read_message_async(reader) == msg
        assert await read_message_async(reader) is None
    finally:
        writer.close()
        await writer.wait_closed()


# ----------------------------------------------------------------------------- property tests


def _strategy(tp: Any) -> Any:
    """A hypothesis strategy for valid values of a message field's type hint."""
    from hypothesis import strategies as st

    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: _strategy(hints[f.name]) for f in dataclasses.fields(tp)}
        return st.builds(tp, **fields)
    scalars = {
        int: st.integers(-(2**63), 2**64 - 1),
        float: st.floats(allow_nan=False),
        str: st.text(max_size=12),
        bool: st.booleans(),
    }
    if tp in scalars:
        return scalars[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=4)
    if origin is dict and args[1] is Any:
        native = st.recursive(
            st.none() | st.booleans() | scalars[int] | scalars[float] | scalars[str] | st.binary(),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(scalars[str], inner),
            max_leaves=8,
        )
        return st.dictionaries(scalars[str], native, max_size=3)
    if origin is dict:  # logit_bias: token ids as decimal strings
        return st.dictionaries(st.integers(0, 10**6).map(str), _strategy(args[1]), max_size=3)
    inner = [a for a in args if a is not type(None)]
    assert len(inner) == 1, tp
    return st.none() | _strategy(inner[0])


def test_random_valid_messages_round_trip() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.one_of([_strategy(cls) for cls in MESSAGE_TYPES.values()]))
    def check(msg: Message) -> None:
        frame = encode_message(msg)
        msg_type, _, length = parse_header(frame[: HEADER.size], DEFAULT_MAX_FRAME_BYTES)
        assert length == len(frame) - HEADER.size
        assert decode_body(msg_type, frame[HEADER.size :]) == msg

    check()


def _decodes_or_protocol_error(msg_type: int, body: bytes) -> None:
    try:
        msg = decode_body(msg_type, body)
    except ProtocolError:
        return
    assert isinstance(msg, tuple(MESSAGE_TYPES.values()))


def test_random_bytes_only_decode_or_raise_protocol_error() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=500, deadline=None)
    @hypothesis.given(st.integers(0, 255), st.binary(max_size=64))
    def check(msg_type: int, body: bytes) -> None:
        _decodes_or_protocol_error(msg_type, body)

    check()


def test_mutated_valid_bodies_only_decode_or_raise_protocol_error() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    bodies = [(msg.TYPE, body_of(msg)) for msg in SAMPLES]

    @hypothesis.settings(max_examples=500, deadline=None)
    @hypothesis.given(st.sampled_from(bodies), st.data())
    def check(sample: tuple[int, bytes], data: Any) -> None:
        msg_type, body = sample
        at = data.draw(st.integers(0, len(body)))
        cut = data.draw(st.integers(0, 3))
        insert = data.draw(st.binary(max_size=3))
        _decodes_or_protocol_error(msg_type, body[:at] + insert + body[at + cut :])

    check()
