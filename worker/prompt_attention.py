"""A prompt chunk's attention in fewer graph nodes (issue #12, session 44).

On a GPU a fused step is bound by the host's work, which grows with the
pass's graph nodes (sessions 38 and 40: about 3 us a node on an H100), and a step
that carries a prompt chunk cost the 0.5B shape about 4 ms over a 3.9-ms
decode step whatever the chunk's size (session 42). A chunk's attention
(many queries, an array mask) is not one of MLX's fused kernels on CUDA
(its vector kernel takes one query a row; the worker keeps cuDNN's off,
worker/backend.py), so `mx.fast.scaled_dot_product_attention` builds its
fallback: q scaled, q's heads unflattened and k and v given a repeat axis,
k transposed, a matmul that broadcasts k, the mask given a repeat axis and
applied by a `where` with its broadcasts, the softmax, a matmul that
broadcasts v and the heads flattened again, about 13 nodes a layer.

This module computes the same attention in five: the query heads that share
a KV head are laid end to end along the query axis (a reshape: heads are
grouped in that order), so each KV head's keys meet all of them in one
matmul with no broadcast of k or v; the scale and the mask are that matmul's
epilogue (one AddMM, `alpha` the scale, C the mask as an additive bias laid
out like the scores once a pass and shared by every layer, `masks`); then
the softmax and the matmul with v, and a reshape back to the heads.

The arithmetic is the fallback's but for where the scale is applied (to the
fp32 accumulator, not to q rounded to the model's dtype) and how the mask
acts (the dtype's lowest value added, where the fallback puts it in place);
a masked score's weight is exactly zero either way. Every row keeps a key it
may attend (its own token; a padded query row attends them all), so no row
is all masked.

Used wherever worker/fused.py's `fused_hidden` runs a chunk (`_attend`:
fused steps, and on CUDA, whose passes are padded, every prompt pass) where
`enabled`:
WorkerConfig.prompt_attention, "auto" off on every backend until a GPU run
times it (docs/architecture.md; Metal's own kernel takes the mask in one
node, so there it would stay off).

Threading: the engine thread only, like every MLX call in the worker.
"""

from __future__ import annotations

import mlx.core as mx

# On where the worker's runner sets it (worker/core.py `runner_for`, from
# WorkerConfig.prompt_attention; process-wide); off: MLX's call, as before
# session 44. bench.variant_probe sets it between steps.
enabled = False


def bias(mask: mx.array, heads: int, kv_heads: int, dtype: mx.Dtype) -> mx.array:
    """The boolean `mask` (rows or 1, 1, queries, keys) as the additive bias
    `attention` adds to its scores (rows, kv_heads, heads/kv_heads x
    queries, keys): 0 where a query may attend a key, the dtype's lowest
    value where not; one array for every layer of a pass."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (queries, keys) too
    rows, _, queries, keys = mask.shape
    repeat = heads // kv_heads
    lowest = mx.array(mx.finfo(dtype).min, dtype)
    additive = mx.where(mask, mx.array(0, dtype), lowest)
    tiled = mx.broadcast_to(additive, (rows, repeat, queries, keys))
    laid = tiled.reshape(rows, 1, repeat * queries, keys)
    return mx.broadcast_to(laid, (rows, kv_heads, repeat * queries, keys))


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, bias: mx.array) -> mx.array:
    """softmax(q k^T x scale + bias) v for q (rows, heads, queries, head
    size) and k, v (rows, kv_heads, keys, head size), `bias` from `bias()`;
    (rows, heads, queries, head size), as the fused kernel returns it."""
    rows, heads, queries, size = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(rows, kv_heads, heads // kv_heads * queries, size)
    scores = mx.addmm(bias, grouped, k.swapaxes(-1, -2), alpha=scale)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v).reshape(rows, heads, queries, size)
