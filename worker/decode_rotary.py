"""The decode rows' heads made and q and k rotated on one CUDA kernel.

After the joined projection (worker/joined.py, `qk_v`) a decode row's q and
k sit side by side in one column view of the matmul's output and v in
another. worker/blocks.py `rotated` makes their heads and rotates q and k
with MLX's ops: a reshape of each, a RoPE (which first copies its strided
input: MLX's CUDA RoPE copies any input that is not row-contiguous and has
more than three dimensions) and a split of the result into q and k. Five
graph nodes and two kernels a layer, and on a GPU a decode step is bound by
the host's work per node (session 38, docs/architecture.md).

`rotated` here is one `mx.fast.cuda_kernel` a layer with three outputs,
q (rows, heads, 1, head size), k and v (rows, KV heads, 1, head size), each
contiguous: a thread per pair of elements rotated (or copied, for v),
reading the views where they lie. The rotation is MLX's own (its CUDA
RoPE: theta = scale x position x inverse frequency, in float32, the
frequency from the base as MLX computes it or from the rope's `_freqs`),
for the rope modules whose parameters it can read (`rope_case`: nn.RoPE,
mlx-lm's Llama3RoPE) over the whole head; anything else keeps blocks.py's
ops.

`enable` puts it in place for one model after `works` checked it against
MLX's ops at that model's shapes; it follows the decode attention kernel
(worker/decode_attention.py), on only where that is on and the
`decode_rotary` setting asks. Off by default: on an H100 (session 42,
`bench.variant_probe`, 60 paired decode steps of 16 streams) it made the
0.5B shape's decode step 4.4% slower than blocks.py's ops (95% interval
1.8-5.6%) and the 8B shape's no faster (0.999, -1.9 to +2.0%).

Threading: the engine thread only, like every MLX call in the worker.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

log = logging.getLogger("mlxd.worker.decode_rotary")

# A thread per pair of a head's elements (its rotation's two, or two of v).
_SOURCE = """
    const int half = D / 2;
    const int heads = HQ + 2 * HK;
    const int rows = qk_shape[0];
    const unsigned int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= static_cast<unsigned int>(rows * heads * half)) return;
    const int i = idx % half;
    const int head = (idx / half) % heads;
    const int row = idx / (half * heads);
    if (head >= HQ + HK) {  // v: copied
        const int h = head - HQ - HK;
        const T* src = vv + row * vv_strides[0] + h * D * vv_strides[1];
        T* dst = v + (row * HK + h) * D;
        dst[i] = src[i * vv_strides[1]];
        dst[i + half] = src[(i + half) * vv_strides[1]];
        return;
    }
    const T* src = qk + row * qk_strides[0] + head * D * qk_strides[1];
    T* dst = head < HQ ? q + (row * HQ + head) * D : k + (row * HK + head - HQ) * D;
    const int a = TRADITIONAL ? 2 * i : i;
    const int b = TRADITIONAL ? 2 * i + 1 : i + half;
    // as MLX's CUDA RoPE computes it (its 1.0 a double there too)
    const float inv_freq = FREQS ? 1.0 / freqs[i]
        : exp2f(-(static_cast<float>(i) / static_cast<float>(half)) * params[1]);
    const float theta = params[0] * static_cast<float>(offset[row]) * inv_freq;
    const float c = cosf(theta);
    const float s = sinf(theta);
    const float x1 = static_cast<float>(src[a * qk_strides[1]]);
    const float x2 = static_cast<float>(src[b * qk_strides[1]]);
    dst[a] = static_cast<T>(x1 * c - x2 * s);
    dst[b] = static_cast<T>(x1 * s + x2 * c);
"""
_THREADS = 256

_kernel: Any = None  # built on first use
_enabled = False
# bench.variant_probe's A/B: blocks.py's ops while set, the kernel enabled.
suspended = False
# Per rope module: (traditional, freqs or None, params [scale, log2(base)]).
_cases: dict[int, tuple[bool, mx.array | None, mx.array]] = {}


def rope_case(rope: Any, head_dim: int) -> tuple[bool, mx.array | None, mx.array] | None:
    """What the kernel needs of `rope` (traditional, frequencies or None,
    [scale, log2(base)]), or None where it cannot take it: a rope type other
    than nn.RoPE or mlx-lm's Llama3RoPE, or one that rotates part of a head."""
    if rope.dims != head_dim:
        return None
    if type(rope) is nn.RoPE:
        # log2 of the base in float32, as MLX's host computes it for its kernel
        log2_base = float(np.log2(np.float32(rope.base)))
        return bool(rope.traditional), None, _params(rope.scale, log2_base)
    if type(rope).__name__ == "Llama3RoPE" and isinstance(getattr(rope, "_freqs", None), mx.array):
        freqs = rope._freqs.astype(mx.float32)
        return bool(rope.traditional), freqs, _params(1.0, 0.0)
    return None


def _params(scale: float, log2_base: float) -> mx.array:
    return mx.array([scale, log2_base], dtype=mx.float32)


def takes(attn: Any, qk: mx.array) -> bool:
    """Whether `rotated` takes this layer's decode rows (enabled, a rope it
    reads, a dtype it was built for)."""
    return (
        _enabled
        and not suspended
        and id(attn.rope) in _cases
        and qk.dtype in (mx.bfloat16, mx.float16, mx.float32)
    )


def rotated(
    attn: Any, qk: mx.array, v: mx.array, rows: int, offset: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """q and k rotated to `offset` (one position a row) and v, as blocks.py's
    `rotated` gives them for one token a row, from `qk_v`'s views."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxd_decode_rotary",
            input_names=["qk", "vv", "offset", "freqs", "params"],
            output_names=["q", "k", "v"],
            source=_SOURCE,
            ensure_row_contiguous=False,
        )
    traditional, freqs, params = _cases[id(attn.rope)]
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    dim = v.shape[-1] // kv_heads
    threads = rows * (heads + 2 * kv_heads) * (dim // 2)
    q, k, v = _kernel(
        inputs=[qk, v, offset, params if freqs is None else freqs, params],
        template=[
            ("T", qk.dtype),
            ("D", dim),
            ("HQ", heads),
            ("HK", kv_heads),
            ("TRADITIONAL", traditional),
            ("FREQS", freqs is not None),
        ],
        grid=(-(-threads // _THREADS) * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, heads, 1, dim), (rows, kv_heads, 1, dim), (rows, kv_heads, 1, dim)],
        output_dtypes=[qk.dtype] * 3,
    )
    return q, k, v


def enable(model: Any) -> bool:
    """Put the kernel in place for `model`'s layers where `works` says it
    gives MLX's rotation there; whether it is."""
    disable()
    try:
        layers = model.model.layers
        attn = layers[0].self_attn
        dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads  # rows: never packed
        dtype = model.model.norm.weight.dtype
    except (AttributeError, IndexError, TypeError, ZeroDivisionError):
        return False
    cases = {}
    for layer in layers:
        if (case := rope_case(layer.self_attn.rope, dim)) is None:
            return False
        cases[id(layer.self_attn.rope)] = case
    if not works(attn, dtype, cases[id(attn.rope)]):
        return False
    global _enabled
    _cases.update(cases)
    _enabled = True
    return True


def enabled() -> bool:
    """Whether `enable` put the kernel in place (`suspended` aside)."""
    return _enabled


def disable() -> None:
    global _enabled
    _enabled = False
    _cases.clear()


def works(attn: Any, dtype: Any, case: tuple[bool, mx.array | None, mx.array]) -> bool:
    """Whether the kernel builds here and rotates as `attn.rope` does (its
    `rope_case`), over 3 rows at offsets far apart, from strided views as
    `qk_v` gives them."""
    heads, kv_heads, rope = attn.n_heads, attn.n_kv_heads, attn.rope
    dim = rope.dims
    try:
        mx.random.seed(0)
        width = (heads + 2 * kv_heads) * dim
        out = mx.random.normal((3, width)).astype(dtype)
        qk, v = mx.split(out, [(heads + kv_heads) * dim], axis=-1)
        offset = mx.array([0, 37, 4000], dtype=mx.int32)
        _cases[id(rope)] = case
        q, k, v_heads = rotated(attn, qk, v, 3, offset)
        both = rope(qk.reshape(3, heads + kv_heads, 1, -1), offset=offset)
        want_q, want_k = both[:, :heads], both[:, heads:]
        tol = 1e-4 if dtype == mx.float32 else 2e-2
        same = all(
            bool(mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tol, rtol=tol).item())
            for a, b in ((q, want_q), (k, want_k))
        ) and bool(mx.array_equal(v_heads, v.reshape(3, kv_heads, 1, -1)).item())
        why = "" if same else "its values are not MLX's"
    except Exception as e:  # any failure: blocks.py's ops serve instead
        why = " ".join(str(e).split())[:300]
    finally:
        _cases.pop(id(rope), None)
    if why:
        log.warning("the decode rotary kernel failed its check: %s", why)
    return not why
