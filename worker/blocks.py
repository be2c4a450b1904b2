"""Each layer's cache-free parts of `fused_hidden`'s pass, compiled with `mx.compile`.

On a GPU the engine's decode step is bound by the host (session 38,
docs/architecture.md "Where a CUDA step's time goes"): about a third of it is
Python building the pass, an MLX call at a time, a dozen a layer. The parts
of a layer that touch no cache are the same function of the same shapes at
every step, so they are traced once per shape and replayed from MLX's
compile cache, in C++, without Python dispatching each op:

- `project`: the input norm and the q/k/v projections (worker/joined.py's
  joined matmul where it exists);
- `rotate` (where q and k are rotated as one, `qk_v`): the heads split out,
  q and k rotated to the rows' offsets (an array: BatchKVCache's per-row
  offsets), v's heads;
- `finish`: the output projection, the residual, the MLP's norm, the MLP
  and its residual.

The KV cache's update and the attention stay outside: the cache's write and
read positions are Python ints that move every step, which would trace anew
at every step (`mx.compile` keys its cache on shapes and such constants).

What compiles is the same graph of the same primitives (the compiler also
fuses runs of elementwise ops, which on the CPU includes the norms' own
decompositions), so the tokens are the same; tests/test_blocks.py checks it
on the test model. On this CPU, a 16-row decode pass of the 32-layer thin32
shape builds in 4.4 ms against 5.7 (`bench.build_probe`).

A layer's functions are made on first use and kept on the layer (plain
attributes, as worker/joined.py's are: not in `model.parameters()`); the
weights they read are closed over, so they are the model's own arrays, not
copies. Each new input shape traces once (a pass's cost in Python, once):
the decode batch's row counts and the padded sizes of fused passes.

Threading: the engine thread only, like every MLX call in the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from worker.joined import mlp, qk_v, qkv

_ATTR = "mlxd_blocks"
_off = False


@contextmanager
def uncompiled() -> Iterator[None]:
    """Passes built inside run every op from Python, as before this module
    (bench.variant_probe and bench.build_probe measure the difference)."""
    global _off
    before, _off = _off, True
    try:
        yield
    finally:
        _off = before


@dataclass(frozen=True, slots=True)
class Blocks:
    """One layer's compiled parts (module docstring)."""

    project: Callable[[mx.array], Any]
    finish: Callable[[mx.array, mx.array], mx.array]
    rotate: Callable[[mx.array, mx.array, mx.array], Any]
    joint: bool  # q and k come out side by side, to be rotated as one


def projected(layer: Any, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array]:
    """q, k and v of the layer's input `x` (the input norm applied); k None
    where q holds q and k side by side, to be rotated as one (`qk_v`)."""
    if _off:
        return _project(layer, x)
    made = _blocks(layer)
    if made.joint:
        qk, v = made.project(x)
        return qk, None, v
    q, k, v = made.project(x)
    return q, k, v


def rotated(
    layer: Any, qk: mx.array, v: mx.array, rows: int, length: int, offset: Any
) -> tuple[mx.array, mx.array, mx.array]:
    """q and k rotated as one to `offset` and split, and v, each (rows,
    heads, length, head size), from the side-by-side q and k of `projected`."""
    attn = layer.self_attn
    heads = attn.n_heads + attn.n_kv_heads
    both = qk.reshape(rows, length, heads, -1)
    v = v.reshape(rows, length, attn.n_kv_heads, -1)
    if _off or not isinstance(offset, mx.array):
        return _rotate(attn, both, v, offset)
    q, k, v = _blocks(layer).rotate(both, v, offset)
    return q, k, v


def finished(layer: Any, x: mx.array, attended: mx.array) -> mx.array:
    """The layer's output from its input `x` and its attention's `attended`
    (tokens x heads' width), before the output projection."""
    if _off:
        return _finish(layer, x, attended)
    return _blocks(layer).finish(x, attended)


def _project(layer: Any, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array]:
    attn = layer.self_attn
    normed = layer.input_layernorm(x)
    together = qk_v(attn, normed)
    if together is not None:
        return together[0], None, together[1]
    q, k, v = qkv(attn, normed)
    return q, k, v


def _rotate(
    attn: Any, both: mx.array, v: mx.array, offset: Any
) -> tuple[mx.array, mx.array, mx.array]:
    both = attn.rope(both.transpose(0, 2, 1, 3), offset=offset)
    q, k = mx.split(both, [attn.n_heads], axis=1)
    return q, k, v.transpose(0, 2, 1, 3)


def _finish(layer: Any, x: mx.array, attended: mx.array) -> mx.array:
    h = x + layer.self_attn.o_proj(attended)
    return h + mlp(layer.mlp, layer.post_attention_layernorm(h))


def _blocks(layer: Any) -> Blocks:
    made: Blocks | None = getattr(layer, _ATTR, None)
    if made is not None:
        return made
    attn = layer.self_attn
    width = layer.input_layernorm.weight
    probe = mx.zeros((1, int(width.shape[-1])), width.dtype)
    joint = qk_v(attn, probe) is not None

    def project(x: mx.array) -> tuple[mx.array, ...]:
        q, k, v = _project(layer, x)
        return (q, v) if k is None else (q, k, v)

    made = Blocks(
        project=mx.compile(project),
        finish=mx.compile(lambda x, attended: _finish(layer, x, attended)),
        rotate=mx.compile(lambda both, v, offset: _rotate(attn, both, v, offset)),
        joint=joint,
    )
    # A plain attribute (nn.Module keeps only arrays and modules as children).
    object.__setattr__(layer, _ATTR, made)
    return made
