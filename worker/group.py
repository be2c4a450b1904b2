"""Lock-step broadcast for a worker group sharded with mx.distributed.

A model too large for one machine (or one GPU) runs as a group of N ranks,
each holding 1/N of the weights and KV heads (mlx-lm's `model.shard`). Rank 0
is the worker the gateway talks to. Every engine iteration rank 0 broadcasts
one `Round` to all ranks through MLX's own collectives (no side channel): the
commands it accepted (Add, Abort) and its step plan (admissions, chunk size).
Every rank applies the same commands and runs the same plan, so every rank's
BatchGenerator takes identical steps and the model's collectives line up.
Sampling needs no broadcast: after the sharded model's all-reduce every rank
has the same logits, the same samplers and the same keys.

Wire format of a round: an int32 length, then that many bytes (msgpack of
[stop, [protocol frames], [[request id, evict bytes], ...], chunk | None]),
each sent with `all_sum` where followers contribute zeros.

Threading: the engine thread of each rank only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgpack
import numpy as np

from protocol.frames import HEADER, parse_header
from protocol.messages import Abort, Add, decode_body, encode_message
from worker.core import StepPlan


@dataclass(slots=True)
class Round:
    stop: bool = False
    commands: list[Add | Abort] = field(default_factory=list)
    plan: StepPlan | None = None


def init_group(backend: str) -> Any:
    """Join the group described by this process's environment (MLX_RANK, MLX_HOSTFILE...)."""
    return mx.distributed.init(backend=backend, strict=True)


class GroupLink:
    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.size = int(group.size())
        # Set to the generator's stream once it exists (see broadcast).
        self.stream: Any = None

    def broadcast(self, rnd: Round | None) -> Round:
        """Rank 0 passes its round; the others pass None. Every rank gets rank 0's round."""
        # mlx-lm evaluates the next decode step asynchronously on its generation
        # stream, and that step's all-reduces must not interleave with ours:
        # ordering both on one stream keeps every rank's collectives in step.
        with mx.stream(
            self.stream if self.stream is not None else mx.default_stream(mx.default_device())
        ):
            return self._broadcast(rnd)

    def _broadcast(self, rnd: Round | None) -> Round:
        payload = _encode(rnd) if self.rank == 0 and rnd is not None else b""
        length = mx.distributed.all_sum(mx.array([len(payload)], dtype=mx.int32), group=self.group)
        n = int(length.item())  # type: ignore[arg-type]
        if self.rank == 0:
            buf = mx.array(np.frombuffer(payload, dtype=np.uint8))
        else:
            buf = mx.zeros((n,), dtype=mx.uint8)
        data = mx.distributed.all_sum(buf, group=self.group)
        mx.eval(data)
        return _decode(bytes(np.array(data, copy=False)))


def _encode(rnd: Round) -> bytes:
    plan = rnd.plan
    return msgpack.packb(
        [
            rnd.stop,
            [encode_message(c) for c in rnd.commands],
            [[rid, evict] for rid, evict in plan.admit] if plan is not None else [],
            plan.chunk if plan is not None else None,
        ]
    )


def _decode(data: bytes) -> Round:
    stop, frames, admit, chunk = msgpack.unpackb(data, raw=False)
    commands: list[Add | Abort] = []
    for frame in frames:
        msg_type, _, length = parse_header(frame[: HEADER.size], len(frame))
        msg = decode_body(msg_type, frame[HEADER.size : HEADER.size + length])
        if isinstance(msg, (Add, Abort)):
            commands.append(msg)
    plan = None if chunk is None else StepPlan(int(chunk), [(r, int(e)) for r, e in admit])
    return Round(bool(stop), commands, plan)
