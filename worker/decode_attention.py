"""Batched decode attention on CUDA that reads only each row's own keys.

A decode step's rows sit in mlx-lm's BatchKVCache left-padded to the longest
row, and mlx-lm hands MLX a boolean mask per row. MLX's CUDA backend has a
fused one-query attention kernel (`sdpa_vector`), but not for an array mask
(mlx/backend/cuda/scaled_dot_product_attention.cu, `supports_sdpa_vector`,
v0.32): every batched decode step takes MLX's unfused path instead, five
kernels a layer (scale, QK^T, where, softmax, PV) over the padded length. On
the H200 (session 17, bench.shape_probe, 8B dimensions) a 16-row decode
attention cost 0.48 ms synchronised at 2,048 keys against 0.40 at 512, and
on the 0.5B shape every decode step after a 2,000-token row joined took
9.5-9.8 ms against 7.2-7.5 before: each row paid for the longest one's keys.

`ragged_attention` is one kernel a layer (`mx.fast.cuda_kernel`): a block
per (row, KV head), taking the query heads that share that KV head
(grouped-query attention: 4 on the 8B shape, 7 on the 0.5B; as many as its
shared memory holds, `shared_heads`), so each row's keys and values are read
once for all of them. Eight warps walk the keys in tiles of 32, each lane a
key, with an online softmax in float32 per query head; tiles wholly masked
are skipped without reading their keys or values. It takes the mask mlx-lm
built, so which keys count is mlx-lm's decision, not a second reading of the
cache's padding.

The kernel reads a row's keys up to the mask's width, so the keys and values
may be a cache's whole buffers (`takes_buffers`: worker/fused.py writes the
decode rows' caches in place and hands them over unsliced, two slice nodes
a layer fewer), and with `flat` it writes its output as (rows, heads x
dim), the output projection's input (a reshape node fewer).

`install` puts `attention` in place of mlx-lm's `scaled_dot_product_attention`
in the model modules and in worker/fused.py; every other call (prompt
chunks, one row without a mask, quantized caches, sinks, head sizes other
than 64 and 128, more than `MAX_KEYS` keys) goes to mlx-lm's own function.
The kernel computes in float32 where MLX's path rounds the scores to the
model's dtype, so outputs agree within that rounding, not bit for bit.
Whether it is used is `decode_attention` (worker/backend.py: on by default
on CUDA; configuration.md).

Measured on the H200 (bench.decode_probe: one step's attention, every
layer, synchronised, median of 20; records in docs/benchmarks/). Session 18
ran a first kernel with a block per (row, query head): a third to a fifth of
MLX's time. Session 19 ran it beside this one, which replaced it: on the 8B
shape 16 rows at 2,000 keys 2.7 ms against 5.6 (MLX 10.1-10.3), 64 rows at
300-800 keys 3.4 against 7.3 (MLX 16.3-16.6), one row at 2,000 0.61 against
0.91 (MLX 1.6); on the 0.5B shape 64 rows 0.95 against 1.72 (MLX 5.5), and
one row the same (0.40-0.49 against 0.40-0.46).

Threading: the engine thread only, like every MLX call in the worker.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

log = logging.getLogger("mlxd.worker.decode_attention")
MLX_LM_ATTENTION = base.scaled_dot_product_attention
HEAD_DIMS = (64, 128)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# One block walks all of a row's keys: at batch 1 a long row would leave most
# of the GPU idle where MLX's matmuls spread over it. Beyond this, MLX's path
# (bench.decode_probe measures where the line should be).
MAX_KEYS = 4096
WARPS = 8
SHARED_BYTES = 40960  # of the 48 KiB a block may hold statically


# A block per row, KV head and GQ of its query heads.
_SOURCE = """
    // A block: one row, one KV head, GQ of the query heads that share it.
    constexpr int DPL = D / 32;  // the dimensions of V one lane accumulates
    constexpr int VEC = 16 / sizeof(T);  // elements in one 16-byte load of K
    __shared__ float qs[GQ][D];
    __shared__ float wm[WARPS][GQ];
    __shared__ float wl[WARPS][GQ];
    __shared__ float wacc[WARPS][GQ][D];

    const int heads = q_shape[1];
    const int kv_heads = k_shape[1];
    const int group = heads / kv_heads;
    const int parts = group / GQ;  // blocks per KV head
    const int keys = mask_shape[3];  // k and v may be longer (`takes_buffers`)
    const int row = blockIdx.x / (kv_heads * parts);
    const int rest = blockIdx.x % (kv_heads * parts);
    const int kv_head = rest / parts;
    const int head0 = kv_head * group + (rest % parts) * GQ;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;

    for (int i = threadIdx.x; i < GQ * D; i += blockDim.x) {
        const int g = i / D;
        const int d = i % D;
        const T* qp = q + row * q_strides[0] + (head0 + g) * q_strides[1];
        qs[g][d] = static_cast<float>(qp[d * q_strides[3]]) * scale[0];
    }
    __syncthreads();

    const T* kp = k + row * k_strides[0] + kv_head * k_strides[1];
    const T* vp = v + row * v_strides[0] + kv_head * v_strides[1];
    const bool* mp = mask + (mask_shape[0] == 1 ? 0 : row * mask_strides[0]);
    const int64_t ks = k_strides[2];
    const int64_t vs = v_strides[2];
    // 16-byte loads of a key's row need it contiguous and aligned.
    const bool packed = k_strides[3] == 1 && (ks * sizeof(T)) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(kp) % 16 == 0;

    float m[GQ];
    float l[GQ];
    float acc[GQ][DPL];
    #pragma unroll
    for (int g = 0; g < GQ; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        #pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = 0.0f;
    }

    for (int base = warp * 32; base < keys; base += WARPS * 32) {
        const int key = base + lane;
        const bool valid = key < keys && mp[key * mask_strides[3]];
        if (!__any_sync(0xffffffff, valid)) continue;  // the whole tile is masked
        float s[GQ];
        #pragma unroll
        for (int g = 0; g < GQ; ++g) s[g] = 0.0f;
        if (valid) {
            const T* kr = kp + key * ks;
            if (packed) {
                #pragma unroll
                for (int d = 0; d < D; d += VEC) {
                    const uint4 raw = *reinterpret_cast<const uint4*>(kr + d);
                    const T* part = reinterpret_cast<const T*>(&raw);
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float kv = static_cast<float>(part[j]);
                        #pragma unroll
                        for (int g = 0; g < GQ; ++g) s[g] += qs[g][d + j] * kv;
                    }
                }
            } else {
                for (int d = 0; d < D; ++d) {
                    const float kv = static_cast<float>(kr[d * k_strides[3]]);
                    #pragma unroll
                    for (int g = 0; g < GQ; ++g) s[g] += qs[g][d] * kv;
                }
            }
        }
        float p[GQ];
        #pragma unroll
        for (int g = 0; g < GQ; ++g) {
            float top = valid ? s[g] : -INFINITY;
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
            const float fresh = fmaxf(m[g], top);  // finite: some key of the tile is valid
            const float carry = expf(m[g] - fresh);
            p[g] = valid ? expf(s[g] - fresh) : 0.0f;
            float total = p[g];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffff, total, o);
            l[g] = l[g] * carry + total;
            #pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] *= carry;
            m[g] = fresh;
        }
        const unsigned live = __ballot_sync(0xffffffff, valid);
        for (int j = 0; j < 32; ++j) {
            if (!((live >> j) & 1u)) continue;  // the same in every lane
            const T* vr = vp + (base + j) * vs;
            float vv[DPL];
            #pragma unroll
            for (int i = 0; i < DPL; ++i) {
                vv[i] = static_cast<float>(vr[(lane * DPL + i) * v_strides[3]]);
            }
            #pragma unroll
            for (int g = 0; g < GQ; ++g) {
                const float pj = __shfl_sync(0xffffffff, p[g], j);
                #pragma unroll
                for (int i = 0; i < DPL; ++i) acc[g][i] += pj * vv[i];
            }
        }
    }

    #pragma unroll
    for (int g = 0; g < GQ; ++g) {
        if (lane == 0) {
            wm[warp][g] = m[g];
            wl[warp][g] = l[g];
        }
        #pragma unroll
        for (int i = 0; i < DPL; ++i) wacc[warp][g][lane * DPL + i] = acc[g][i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GQ * D; i += blockDim.x) {
        const int g = i / D;
        const int d = i % D;
        float top = -INFINITY;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, wm[w][g]);
        float sum = 0.0f;
        float o = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            const float c = wm[w][g] == -INFINITY ? 0.0f : expf(wm[w][g] - top);
            sum += wl[w][g] * c;
            o += wacc[w][g][d] * c;
        }
        out[(row * heads + head0 + g) * D + d] = static_cast<T>(sum > 0.0f ? o / sum : 0.0f);
    }
"""

_kernel: Any = None  # built on first use
_installed: Any = None  # what install() put in place
_scales: dict[tuple[float, Any], mx.array] = {}


def available() -> bool:
    """Whether this process can run the kernel (MLX's CUDA backend on the GPU)."""
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:  # an MLX without the cuda module
        return False


def eligible(queries: mx.array, keys: mx.array, mask: Any, sinks: Any, cache: Any) -> bool:
    """Whether a call is a batched decode step's the kernel takes (module doc):
    the mask's width is the keys' count, and `keys` may be a longer buffer."""
    if sinks is not None or hasattr(cache, "bits") or not isinstance(mask, mx.array):
        return False
    if queries.ndim != 4 or queries.shape[2] != 1 or mask.dtype != mx.bool_ or mask.ndim != 4:
        return False
    rows, heads, _, dim = queries.shape
    length = mask.shape[3]
    return (
        dim in HEAD_DIMS
        and keys.shape[-1] == dim
        and queries.dtype in DTYPES
        and keys.dtype == queries.dtype
        and heads % keys.shape[1] == 0
        and mask.shape[0] in (1, rows)
        and mask.shape[1] == 1
        and mask.shape[2] == 1
        and 0 < length <= min(keys.shape[2], MAX_KEYS)
    )


def shared_heads(heads: int, kv_heads: int, dim: int) -> int:
    """The query heads one block takes (GQ): as many of those sharing a KV head
    as the block's shared memory holds (a divisor of the group, so every block
    has the same count)."""
    group = heads // kv_heads
    most = SHARED_BYTES // ((WARPS + 1) * dim * 4)  # float q and per-warp partials
    return max(g for g in range(1, group + 1) if group % g == 0 and g <= most)


def ragged_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    mask: mx.array,
    scale: float,
    flat: bool = False,
) -> mx.array:
    """softmax(scale * q k^T where mask) v for one query per row, (rows, heads,
    1, dim); `flat`: (rows, heads x dim), the same layout as the output
    projection takes it (no reshape node after it)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxd_grouped_decode_attention",
            input_names=["q", "k", "v", "mask", "scale"],
            output_names=["out"],
            source=_SOURCE,
            ensure_row_contiguous=False,
        )
    rows, heads, _, dim = queries.shape
    share = shared_heads(heads, keys.shape[1], dim)
    key = (scale, queries.dtype)
    if (factor := _scales.get(key)) is None:
        factor = _scales[key] = mx.array([scale], dtype=mx.float32)
    (out,) = _kernel(
        inputs=[queries, keys, values, mask, factor],
        template=[("T", queries.dtype), ("D", dim), ("WARPS", WARPS), ("GQ", share)],
        grid=(rows * (heads // share) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, heads * dim) if flat else (rows, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )
    return out


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
    flat: bool = False,
) -> mx.array:
    """mlx-lm's scaled_dot_product_attention, with batched decode steps on the
    kernel. `keys` and `values` may be a cache's whole buffers, longer than
    the mask (`takes_buffers`): mlx-lm's function is handed them cut to it.
    `flat` (one query a row only): the output as (rows, heads x dim)."""
    if eligible(queries, keys, mask, sinks, cache) and values.shape == keys.shape:
        return ragged_attention(queries, keys, values, mask, scale, flat)
    if isinstance(mask, mx.array) and mask.shape[-1] < keys.shape[2]:
        keys, values = keys[:, :, : mask.shape[-1]], values[:, :, : mask.shape[-1]]
    out = MLX_LM_ATTENTION(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return out.reshape(out.shape[0], -1) if flat else out


def takes_buffers() -> bool:
    """Whether the attention in place (`install`) takes a decode step's keys
    and values as the caches' whole buffers, the mask saying how many count
    (worker/fused.py, `_attend`): a slice node fewer for each, every layer."""
    return _installed is attention


def works(case: tuple[Any, int, int, int] = (mx.bfloat16, 64, 4, 2)) -> bool:
    """Whether the kernel builds and gives MLX's answer here, for `case` (dtype,
    head size, query heads, KV heads: `model_case`, the instantiation the model
    will use), on a small batch evaluated now. A GPU whose NVRTC rejects it, or
    an MLX that changed what custom kernels are handed, must cost the worker
    this kernel, not its start, where the warm-up's first decode step would
    raise."""
    dtype, dim, heads, kv_heads = case
    try:
        mx.random.seed(0)
        q = mx.random.normal((3, heads, 1, dim)).astype(dtype)
        # a buffer of 48 slots, 40 of them counted (`takes_buffers`)
        k = mx.random.normal((3, kv_heads, 48, dim)).astype(dtype)
        mask = (mx.arange(40)[None] >= mx.array([0, 30, 39])[:, None]).reshape(3, 1, 1, 40)
        scale = dim**-0.5
        ours = ragged_attention(q, k, k, mask, scale).astype(mx.float32)
        cut = k[:, :, :40]
        theirs = MLX_LM_ATTENTION(q, cut, cut, cache=None, scale=scale, mask=mask)
        flat = ragged_attention(q, k, k, mask, scale, flat=True).astype(mx.float32)
        same = bool(mx.allclose(ours, theirs.astype(mx.float32), atol=2e-2, rtol=2e-2).item())
        same = same and bool(mx.array_equal(flat, ours.reshape(flat.shape)).item())
        why = "" if same else "its values are not MLX's"
    except Exception as e:  # any failure: mlx-lm's attention serves instead
        why = " ".join(str(e).split())[:300]
    if why:
        log.warning("the decode attention kernel failed its check for %s: %s", case, why)
    return not why


def model_case(model: Any) -> tuple[Any, int, int, int] | None:
    """(dtype, head size, query heads, KV heads) of `model`'s first attention
    layer, as `works` takes them; None where the model does not say (then
    `works` checks its own small case)."""
    try:
        inner = getattr(model, "model", model)
        attn = inner.layers[0].self_attn
        heads, kv_heads = int(attn.n_heads), int(attn.n_kv_heads)
        dim = int(attn.k_proj.weight.shape[0]) // kv_heads
        dtype = inner.norm.weight.dtype  # an embedding's weight is packed when quantized
    except (AttributeError, IndexError, TypeError, ZeroDivisionError):
        return None
    return (dtype, dim, heads, kv_heads) if dtype in DTYPES else None


def install(replacement: Any = attention) -> int:
    """Put `replacement` wherever mlx-lm's attention function was imported by
    name (the model modules loaded so far, worker/fused.py); how many places.
    mlx-lm's base module keeps its own, which `attention` calls."""
    global _installed
    if _installed is not None:
        uninstall()
    _installed = replacement
    return _swap(MLX_LM_ATTENTION, replacement)


def uninstall() -> int:
    """Put mlx-lm's function back where install() replaced it."""
    global _installed
    done = _swap(_installed, MLX_LM_ATTENTION) if _installed is not None else 0
    _installed = None
    return done


def _swap(old: Any, new: Any) -> int:
    done = 0
    for name, module in list(sys.modules.items()):
        ours = name.startswith("mlx_lm.models.") and name != "mlx_lm.models.base"
        if (ours or name == "worker.fused") and (
            getattr(module, "scaled_dot_product_attention", None) is old
        ):
            setattr(module, "scaled_dot_product_attention", new)  # noqa: B010
            done += 1
    return done
