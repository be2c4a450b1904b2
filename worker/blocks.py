"""Each layer's cache-free parts of `fused_hidden`'s pass, in fewer graph nodes.

On a GPU the engine's decode step is bound by the host (session 38,
docs/architecture.md "Where a CUDA step's time goes"): the host builds the
pass an MLX op at a time and then evaluates it a node at a time, and both
scale with the graph's nodes, views included (a 16-row llama8b decode pass
is about 980 nodes, half of them transposes, reshapes, splits and slices).
This module owns the parts of a layer that touch no cache:

- `projected`: the input norm and the q/k/v projections (worker/joined.py's
  joined matmul where it exists);
- `rotated` (where q and k are rotated as one, `qk_v`): the heads split
  out, q and k rotated to the rows' offsets, v's heads;
- `finished`: the output projection, the residual, the MLP's norm, the MLP
  and its residual.

Three changes against the model's own modules, each a node fewer per use:

- a plain (unquantized) Linear's weight is transposed once and the view
  kept (worker/joined.py, `dense`): nn.Linear builds `weight.T` anew at
  every call, a Transpose node per projection per step (4 a layer);
- a residual and the projection that feeds it are one AddMM (`_plus`): on
  CUDA one cuBLASLt GEMM that adds the residual as it writes (its C
  operand), where the sum was a GEMM and an Add kernel (2 a layer);
- with one token a row (the decode rows), the heads' axis is made by a
  reshape alone where a reshape and a transpose made it (`rotated`,
  `merged_heads`: q and k, v, and attention's output; 3 a layer): with a
  length of one, both give the same layout; and on CUDA the heads are made
  and q and k rotated by one kernel (worker/decode_rotary.py, session 40:
  the reshapes, the RoPE with its copy and the split of q and k, 4 nodes
  and a kernel a layer fewer).

On an H100 (session 39, the 0.5B shape, 16 rows, `bench.variant_probe
rope,nodes`), with the first two: a decode step 0.926 of session 38's, a
fused step 0.974 (the third came after that run).
Quantized projections keep their own modules (a quantized matmul takes its
weights as they are stored and has no add). `as_before()` builds the pass
as session 38 did (bench.variant_probe and bench.build_probe measure both).

Tried and not kept (session 39, docs/benchmarks/README.md): these parts as
`mx.compile`d functions. On this CPU the build of a 16-row thin32 decode
pass fell by a quarter (the compiler fused the CPU's norm and RoPE
decompositions), but on the H100's host it fell 6% (2.81 -> 2.63 ms on the
0.5B shape) and the engine's steps did not move (bench.variant_probe, 0.995
and 0.999 of the uncompiled decode step): replaying a traced node costs
MLX about what building it from Python does.

Threading: the engine thread only, like every MLX call in the worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from worker import decode_rotary, joined
from worker.joined import dense, mlp_inner, qk_v, qkv


@contextmanager
def as_before() -> Iterator[None]:
    """Passes built inside use the model's own Linear modules, a separate
    Add for each residual and a transpose for each heads' axis (session 38's
    pass; bench.variant_probe, bench.build_probe)."""
    before = joined.plain_pass
    joined.plain_pass = True
    try:
        yield
    finally:
        joined.plain_pass = before


def projected(layer: Any, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array]:
    """q, k and v of the layer's input `x` (the input norm applied); k None
    where q holds q and k side by side, to be rotated as one (`qk_v`)."""
    attn = layer.self_attn
    normed = layer.input_layernorm(x)
    together = qk_v(attn, normed)
    if together is not None:
        return together[0], None, together[1]
    q, k, v = qkv(attn, normed)
    return q, k, v


def rotated(
    layer: Any, qk: mx.array, v: mx.array, rows: int, length: int, offset: Any
) -> tuple[mx.array, mx.array, mx.array]:
    """q and k rotated as one to `offset` and split, and v, each (rows,
    heads, length, head size), from the side-by-side q and k of `projected`."""
    attn = layer.self_attn
    heads = attn.n_heads + attn.n_kv_heads
    if length == 1 and not joined.plain_pass:
        if isinstance(offset, mx.array) and decode_rotary.takes(attn, qk):
            return decode_rotary.rotated(attn, qk, v, rows, offset)
        # One token a row: the heads and the length swap places without a
        # Transpose (the same layout, a node fewer each).
        both, v = qk.reshape(rows, heads, 1, -1), v.reshape(rows, attn.n_kv_heads, 1, -1)
    else:
        both = qk.reshape(rows, length, heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(rows, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = mx.split(attn.rope(both, offset=offset), [attn.n_heads], axis=1)
    return q, k, v


def merged_heads(out: mx.array, rows: int, length: int) -> mx.array:
    """Attention's (rows, heads, length, head size) output as (rows x
    length, heads' width), the output projection's input: for one token a
    row a reshape alone (`rotated`)."""
    if length == 1 and not joined.plain_pass:
        return out.reshape(rows, -1)
    return out.transpose(0, 2, 1, 3).reshape(rows * length, -1)


def finished(layer: Any, x: mx.array, attended: mx.array) -> mx.array:
    """The layer's output from its input `x` and its attention's `attended`
    (tokens x heads' width, before the output projection)."""
    h = _plus(x, layer.self_attn.o_proj, attended)
    normed = layer.post_attention_layernorm(h)
    inner = mlp_inner(layer.mlp, normed)
    if inner is None:
        return h + layer.mlp(normed)  # not joined: the model's own MLP
    return _plus(h, layer.mlp.down_proj, inner)


def _plus(residual: mx.array, linear: Any, x: mx.array) -> mx.array:
    """`residual + linear(x)`: one AddMM for a plain Linear without a bias
    (module docstring)."""
    if joined.plain_pass or type(linear) is not nn.Linear or "bias" in linear:
        return residual + linear(x)
    return mx.addmm(residual, x, dense(linear).weight_t)
