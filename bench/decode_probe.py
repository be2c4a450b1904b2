"""Decode attention probe: MLX's path against worker/decode_attention.py's kernel.

    python -m bench.decode_probe [--shape tiny|qwen0.5b|llama8b] [--reps 20] [--out probe.json]

Owns one question of issue #12 (session 18): a batched decode step's
attention on CUDA is MLX's unfused path (an array mask rules out its vector
kernel), whose cost follows the longest row. For each batch below, rows
left-padded in a cache buffer as mlx-lm's BatchKVCache holds them, with the
mask mlx-lm builds, at the shape's dimensions, this times the attention of
every layer of one step (the shape's layer count of calls, evaluated
together and synchronised, the median of `--reps`), through mlx-lm's
function and the kernel, and the largest difference between the kernel's
outputs and MLX's. CUDA only: elsewhere the kernel does not exist and the
probe says so. (Session 19 ran it with a second kernel beside the first; the
faster, a block per KV head and its query heads, replaced the other.)

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# (name, the rows' KV lengths): steady batches, and a long row joined to them.
BATCHES = (
    ("1 row at 512", (512,)),
    ("1 row at 2000", (2000,)),
    ("16 rows at 512", (512,) * 16),
    ("16 rows at 512, one at 2000", (512,) * 16 + (2000,)),
    ("16 rows at 2000", (2000,) * 16),
    ("64 rows at 300-800", tuple(300 + (37 * i) % 500 for i in range(64))),
    ("64 rows at 300-800, one at 4000", (*(300 + (37 * i) % 500 for i in range(64)), 4000)),
)


def _theirs(q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
    from worker import decode_attention as da

    return da.MLX_LM_ATTENTION(q, k, v, cache=None, scale=scale, mask=mask)


def _ours(q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
    from worker import decode_attention as da

    return da.ragged_attention(q, k, v, mask, scale)


def _median_ms(attend: Any, args: tuple[Any, ...], layers: int, reps: int) -> float:
    """Median ms of `layers` calls evaluated together and synchronised, after
    one untimed round (first use: compiles, queries, allocates)."""
    import mlx.core as mx

    mx.eval([attend(*args) for _ in range(layers)])
    times = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([attend(*args) for _ in range(layers)])
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return round(statistics.median(times), 3)


def probe(shape: Any, reps: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask

    dt = getattr(mx, shape.dtype)
    heads, kv_heads = shape.heads, shape.kv_heads
    dim = shape.hidden // heads
    out: dict[str, Any] = {}
    for name, lengths in BATCHES:
        rows, longest = len(lengths), max(lengths)
        buffer = 256 * (longest // 256 + 1)  # room past the end, as a decode batch's
        q = mx.random.normal((rows, heads, 1, dim)).astype(dt)
        kb = mx.random.normal((rows, kv_heads, buffer, dim)).astype(dt)
        vb = mx.random.normal((rows, kv_heads, buffer, dim)).astype(dt)
        pad = mx.array([longest - n for n in lengths])
        mask = create_causal_mask(1, longest - 1, left_padding=pad)
        k, v = kb[..., :longest, :], vb[..., :longest, :]
        mx.eval(q, kb, vb, mask)
        args = (q, k, v, mask, dim**-0.5)
        entry: dict[str, Any] = {"rows": rows, "longest": longest}
        runs = (("mlx", _theirs), ("kernel", _ours), ("mlx_again", _theirs))
        for label, attend in runs:
            entry[f"{label}_ms"] = _median_ms(attend, args, shape.layers, reps)
        a = _theirs(*args).astype(mx.float32)
        b = _ours(*args).astype(mx.float32)
        entry["max_abs_diff"] = mx.max(mx.abs(a - b)).item()
        entry["max_abs_out"] = mx.max(mx.abs(a)).item()
        out[name] = entry
        print(
            f"{name}: {shape.layers} layers' attention, mlx {entry['mlx_ms']} / "
            f"{entry['mlx_again_ms']} ms, kernel {entry['kernel_ms']} ms; max |diff| "
            f"{entry['max_abs_diff']:.3g} of max |out| {entry['max_abs_out']:.3g}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from bench.models import SHAPES
    from worker import decode_attention as da

    if not da.available():
        print("decode_probe: the kernel needs MLX's CUDA backend", file=sys.stderr)
        return 2
    result = {"shape": args.shape, "batches": probe(SHAPES[args.shape], args.reps)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
