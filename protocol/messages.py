"""Messages: the typed gateway <-> worker vocabulary, one encoder and one validating decoder.

This module owns the message schema and the body codec. Each top-level message is a
frozen, slotted dataclass with a ``TYPE`` id; ``SamplingParams`` and ``RequestOutput``
are nested structs without one. The dataclass type hints are the schema: the
decoder is compiled from them once per class, so there is no per-class code.

Body encoding: msgpack of an ARRAY of the field values in declared order; a nested
struct is itself an array of its fields. ``logit_bias`` maps token ids written as
decimal strings (as in the OpenAI API) to biases, because msgpack map keys are
strings. ``RequestOutput.top_logprobs`` holds, per generated token, a list of
``[token_id, logprob]`` pairs typed ``list[float]``: the token id travels as a number
and decodes as a float (exact for any vocabulary size), so readers take ``int(pair[0])``.

Evolution rules (within one PROTOCOL_VERSION):

- The encoder leaves off trailing fields that still hold their plain default
  (not a default_factory): the decoder fills them in.
- Fields are only ever added at the END of a message, with a default. Never
  reorder, rename-with-new-meaning, retype or remove a field; never reuse a TYPE id.
- The decoder accepts a body with fewer trailing fields when the missing ones have
  defaults (an older peer), and ignores extra trailing fields (a newer peer).
- Anything else is a ``ProtocolError``: an unknown TYPE, fewer fields than the
  required ones, a field of the wrong type (``bool`` is not an ``int``; an ``int``
  is accepted for a ``float`` and converted), a body that is not valid msgpack or
  has trailing bytes, and any msgpack ext type (timestamps included).
- Changes that break these rules need a new PROTOCOL_VERSION.

No pickle, ever: bodies are decoded with ``raw=False``, ``strict_map_key=True``, an
``ext_hook`` that refuses, and string/bin/array/map lengths bounded by the body size,
which the frame reader has already bounded by ``max_frame_bytes``. ``dict[str, Any]``
fields (``Utility.args``, ``UtilityResult.result``, ``StepOutputs.stats``) are
free-form; their values must be msgpack-native (None, bool, int, float, str, bytes,
lists and str-keyed dicts of those).

The encoder does not validate field types (it would double the hot-path cost); the
receiver's decoder does. Values msgpack cannot encode (numpy scalars, sets, ints
beyond 64 bits) raise ``ProtocolError`` at the sender.

Threading: ``encode_message``, ``decode_body`` and ``expect`` are pure functions and
safe to call from any thread; messages are immutable (do not mutate their lists).
"""

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, NoReturn, TypeAlias

import msgpack

from protocol.frames import DEFAULT_MAX_FRAME_BYTES, ProtocolError, pack_frame

# ---------------------------------------------------------------------------- nested structs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # "token id" -> bias. The keys' meaning is checked by the worker per request (a
    # bad key rejects that request), not here: a decode error would drop the
    # connection and every request on it.
    logit_bias: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float] | None = None  # one per token in token_ids
    top_logprobs: list[list[list[float]]] | None = None  # per token: [[token_id, logprob], ...]
    cached_tokens: int = 0
    error: str = ""
    # On a request's first output: seconds it spent in the worker's queue, and
    # from admission to its first token (prefill). The gateway places them on
    # its own clock, ending at the arrival of this output.
    queued_s: float = 0.0
    prefill_s: float = 0.0


# ------------------------------------------------------------------ gateway <-> worker messages


@dataclass(frozen=True, slots=True)
class Hello:
    TYPE: ClassVar[int] = 1
    protocol_version: int
    epoch: int
    token: str = ""


@dataclass(frozen=True, slots=True)
class Ready:
    TYPE: ClassVar[int] = 2
    epoch: int
    model_id: str
    model_path: str
    identity: str
    context_length: int
    max_batch: int
    kv_bytes_per_token: int
    memory_budget: int
    backend: str
    blas: str
    eos_token_ids: list[int]
    pid: int
    load_time_s: float = 0.0
    vocab_size: int = 0  # 0: unknown; token ids must be below it


@dataclass(frozen=True, slots=True)
class Failed:
    TYPE: ClassVar[int] = 3
    reason: str
    exit_code: int


@dataclass(frozen=True, slots=True)
class Add:
    TYPE: ClassVar[int] = 4
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    # Decoding constraint as JSON (worker/constraints.py): a grammar and/or a thinking
    # budget. "" = unconstrained.
    constraint: str = ""


@dataclass(frozen=True, slots=True)
class Abort:
    TYPE: ClassVar[int] = 5
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Utility:
    TYPE: ClassVar[int] = 6
    call_id: int
    method: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class UtilityResult:
    TYPE: ClassVar[int] = 7
    call_id: int
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True, slots=True)
class Shutdown:
    TYPE: ClassVar[int] = 8


@dataclass(frozen=True, slots=True)
class StepOutputs:
    TYPE: ClassVar[int] = 9
    epoch: int
    step: int
    outputs: list[RequestOutput]
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    TYPE: ClassVar[int] = 10
    epoch: int
    step: int
    active: int
    queued: int
    monotonic_ns: int
    max_step_s: float = 0.0  # the longest step the worker expects now (watchdog window)


@dataclass(frozen=True, slots=True)
class Dead:
    TYPE: ClassVar[int] = 11
    reason: str
    exit_code: int


Message: TypeAlias = (
    Hello
    | Ready
    | Failed
    | Add
    | Abort
    | Utility
    | UtilityResult
    | Shutdown
    | StepOutputs
    | Heartbeat
    | Dead
)

GATEWAY_TO_WORKER: Final[frozenset[type]] = frozenset({Hello, Add, Abort, Utility, Shutdown})
WORKER_TO_GATEWAY: Final[frozenset[type]] = frozenset(
    {Ready, Failed, UtilityResult, StepOutputs, Heartbeat, Dead}
)
_MESSAGES: list[type[Message]] = sorted(GATEWAY_TO_WORKER | WORKER_TO_GATEWAY, key=lambda c: c.TYPE)
MESSAGE_TYPES: Final[dict[int, type]] = {cls.TYPE: cls for cls in _MESSAGES}
if len(MESSAGE_TYPES) != len(_MESSAGES):
    raise TypeError("two message classes share a TYPE id")


def expect(msg: Message, allowed: frozenset[type]) -> Message:
    """msg itself, or ProtocolError when its class is not in allowed (the wrong direction)."""
    if type(msg) not in allowed:
        raise ProtocolError(f"{type(msg).__name__} is not expected on this side of the connection")
    return msg


# ------------------------------------------------------------------------------------ encoder


def _field_getter(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    get: Callable[[Any], tuple[Any, ...]]
    if len(names) >= 2:
        get = operator.attrgetter(*names)  # returns the tuple of values, in C
    else:
        get = lambda obj: tuple(getattr(obj, name) for name in names)  # noqa: E731
    # Trailing fields still at their (plain) defaults are left off the wire: the
    # decoder fills them in, so optional fields added over time cost no bytes
    # in StepOutputs until they are used.
    defaults = [f.default for f in fields]
    keep = len(fields)
    while keep > 0 and defaults[keep - 1] is not dataclasses.MISSING:
        keep -= 1
    if keep == len(fields):
        return get

    def trimmed(obj: Any) -> tuple[Any, ...]:
        values = get(obj)
        end = len(values)
        while (
            end > keep
            and values[end - 1] == defaults[end - 1]
            and (type(values[end - 1]) is type(defaults[end - 1]))
        ):
            end -= 1
        return values[:end]

    return trimmed


_FIELD_GETTERS: Final = {
    cls: _field_getter(cls) for cls in (SamplingParams, RequestOutput, *_MESSAGES)
}


def _to_wire(obj: Any) -> tuple[Any, ...]:
    """msgpack's hook for non-native objects: a struct becomes the array of its fields."""
    getter = _FIELD_GETTERS.get(type(obj))
    if getter is None:
        raise TypeError(f"cannot encode a {type(obj).__name__}")
    return getter(obj)


def encode_message(msg: Message) -> bytes:
    """The full frame (header + msgpack body) for one message."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TYPE", -1)) is not cls:
        raise ProtocolError(f"{cls.__name__} is not a message")
    try:
        body = msgpack.packb(msg, default=_to_wire, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {cls.__name__}: {e}") from None
    return pack_frame(cls.TYPE, body)


# ------------------------------------------------------------------------------------ decoder
#
# Two layers, both derived from the type hints once per class:
# - converters (_compile): small closures that check a value and return it (an int is
#   converted for a float) or raise ProtocolError with what was expected;
# - a generated struct decoder (_struct_decoder): straight-line code per class, with the
#   common valid case checked inline (types compared in C, lists checked with one
#   issuperset(map(type, ...)) call, no copies), calling the converters only for values
#   that need converting or are invalid. StepOutputs is decoded every engine step.

_Convert: TypeAlias = Callable[[Any], Any]
_EXACT: Final = (int, str, bool, float)  # decoded msgpack scalars: compared by exact type


def _fail(expected: str, value: object) -> NoReturn:
    got = type(value).__name__
    if type(value) is list:
        got += f" of {'/'.join(sorted({type(x).__name__ for x in value})) or 'nothing'}"
    raise ProtocolError(f"expected {expected}, got {got}")


def _compile(tp: Any) -> _Convert:
    """A converter for values of type hint tp: the checked value, or ProtocolError."""
    expected = str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
    if tp in _EXACT:

        def scalar(value: Any) -> Any:
            if type(value) is tp:  # exact: a bool is not an int
                return value
            if tp is float and type(value) is int:
                return float(value)
            _fail(expected, value)

        return scalar
    if dataclasses.is_dataclass(tp):
        return _struct_decoder(tp)  # type: ignore[arg-type]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _compile(args[0] if args[1] is type(None) else args[1])
        return lambda value: None if value is None else inner(value)
    if origin is list:
        item = _compile(args[0])

        def array(value: Any) -> Any:
            if type(value) is list:
                return [item(x) for x in value]
            _fail(expected, value)

        return array
    if origin is dict and args[0] is str:
        val = None if args[1] is Any else _compile(args[1])  # Any: any msgpack-native value

        def mapping(value: Any) -> Any:
            if type(value) is dict and all(type(k) is str for k in value):
                return value if val is None else {k: val(v) for k, v in value.items()}
            _fail(expected, value)

        return mapping
    raise TypeError(f"unsupported field type {tp!r}")


def _inline_check(tp: Any) -> str | None:
    """A Python expression true when `x` is a valid tp that needs no conversion, if cheap."""
    if tp in _EXACT:
        return f"type(x) is {tp.__name__}"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _inline_check(args[0] if args[1] is type(None) else args[1])
        return "x is None" if inner is None else f"(x is None or {inner})"
    if origin is list and args[0] in _EXACT:  # a one-token step is the commonest list
        item = args[0].__name__
        return (
            f"(type(x) is list and (len(x) == 1 and type(x[0]) is {item}"
            f" or _only_{item}.issuperset(map(type, x))))"
        )
    if origin is dict and args == (str, Any):
        return "(type(x) is dict and _only_str.issuperset(map(type, x)))"
    return None


def _with_context(where: str, convert: _Convert) -> _Convert:
    def converter(value: Any) -> Any:
        try:
            return convert(value)
        except ProtocolError as e:
            raise ProtocolError(f"{where}: {e}") from None

    return converter


@functools.cache
def _struct_decoder(cls: type) -> _Convert:
    """Generate cls's decoder: array of field values -> instance, by the module's rules."""
    name, fields, hints = cls.__name__, dataclasses.fields(cls), typing.get_type_hints(cls)
    if "__slots__" not in vars(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{name} must be a frozen dataclass with slots=True")
    missing = dataclasses.MISSING
    required = sum(f.default is missing and f.default_factory is missing for f in fields)

    def pad(n: int) -> list[Any]:
        """Fresh defaults for the trailing fields an older peer did not send."""
        if n < required:
            raise ProtocolError(f"{name} has {n} fields, needs at least {required}")
        return [
            f.default if f.default_factory is missing else f.default_factory() for f in fields[n:]
        ]

    def post_init(obj: Any) -> None:
        try:
            obj.__post_init__()
        except ValueError as e:
            raise ProtocolError(f"{name}: {e}") from None

    # The generated code fills a plain slotted twin of cls, then gives the object cls's
    # class: identical slots make that assignment legal, and it skips the frozen __init__'s
    # object.__setattr__ per field, which costs more than all the checks together.
    env: dict[str, Any] = {f"_only_{t.__name__}": frozenset({t}) for t in _EXACT}
    twin = type(f"{name}Twin", (), {"__slots__": vars(cls)["__slots__"]})
    env |= {"cls": cls, "Twin": twin, "pad": pad, "post_init": post_init, "fail": _fail}
    lines = [
        "def decode(v):",
        "    if type(v) is not list:",
        f"        fail('{name} (an array of fields)', v)",
        f"    if len(v) < {len(fields)}:",
        "        v = v + pad(len(v))",
        "    o = Twin()",
    ]
    for i, f in enumerate(fields):
        tp = hints[f.name]
        env[f"convert{i}"] = _with_context(f"{name}.{f.name}", _compile(tp))
        check = _inline_check(tp)
        if check is None:
            lines.append(f"    o.{f.name} = convert{i}(v[{i}])")
        else:
            lines += [f"    x = v[{i}]", f"    o.{f.name} = x if {check} else convert{i}(x)"]
    lines.append("    o.__class__ = cls")
    if hasattr(cls, "__post_init__"):
        lines.append("    post_init(o)")
    lines.append("    return o")
    exec("\n".join(lines), env)
    decode: _Convert = env["decode"]
    return decode


_DECODERS: Final[dict[int, _Convert]] = {t: _struct_decoder(c) for t, c in MESSAGE_TYPES.items()}


def _reject_ext(code: int, data: bytes) -> NoReturn:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


def decode_body(
    msg_type: int, body: bytes | bytearray, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Message:
    """Decode and validate one message body; every invalid input raises ProtocolError."""
    decode = _DECODERS.get(msg_type)
    if decode is None:
        raise ProtocolError(f"unknown message type {msg_type}")
    size = len(body)
    if size > max_frame_bytes:
        raise ProtocolError(f"body of {size} bytes exceeds the limit of {max_frame_bytes}")
    try:
        raw = msgpack.unpackb(
            body,
            use_list=True,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,  # every element takes at least one byte
            max_map_len=size // 2,
            max_ext_len=0,  # also refuses timestamps, which bypass ext_hook
        )
    except Exception as e:  # msgpack raises several types; all mean a bad body
        raise ProtocolError(f"invalid msgpack body: {type(e).__name__}: {e}") from None
    result: Message = decode(raw)
    return result
