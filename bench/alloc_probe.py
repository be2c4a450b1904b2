"""Allocation probe: what a KV buffer growth costs on MLX's allocator, and how
much of it is the allocation.

    python -m bench.alloc_probe [--shape llama8b] [--rows 16] [--keep-freed]
                                [--out probe.json]

Owns one question of issue #12 (session 36): in an H100 step trace of
llama8b's mixed-pressure scenario (16 streams) the decode step in which the
batch's KV buffers grew by their 256 slots took 21-24 ms against 11.5 around
it, and the step after a long prompt joined (a buffer of a new size again)
15 ms against 6.6 even with its join synchronised apart (`bench.admit_probe`).
The copy that growth makes is about 1.6 GB, a millisecond or two on that GPU.
Every size is new to MLX's buffer cache, which reuses a freed buffer only of
about the same size, so each growth allocates all its buffers from CUDA's
memory pool; bench/cuda_pool.py says why that may cost.

Every layer's keys and values (the shape's layers, KV heads and head size,
`--rows` rows) start at 512 slots and grow 256 at a time to 2,560, as
worker/batch_padding.py's `aligned_update_and_fetch` grows them (a zeroed
buffer, the old slots copied in), each growth synchronised and timed:

- `fresh`: the first pass through the sizes (the pool and MLX's cache have
  never held them);
- `cached`: the same growths again, every size now in MLX's cache: the zero
  fill and the copy alone;
- `after_clear`: again after `mx.clear_cache()` and a synchronisation, which
  hand the cache back to CUDA's pool (and, at the default threshold, the
  pool's memory back to the driver).

`--keep-freed` first raises the pool's release threshold to the device's size
(bench/cuda_pool.py), so `after_clear` reuses the pool's memory.
`--host-arrays` also times making small arrays from host lists while the
device has work queued (`host_arrays`: whether that waits for the queue).

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

START, STEP, END = 512, 256, 2560


def _growths(arrays: list[Any], mx: Any) -> tuple[list[Any], list[float]]:
    """`arrays` grown from START to END slots, one synchronised growth at a
    time: the grown arrays and each growth's milliseconds."""
    times = []
    for size in range(START + STEP, END + STEP, STEP):
        mx.synchronize()
        t = time.perf_counter()
        grown = []
        for a in arrays:
            g = mx.zeros((*a.shape[:2], size, a.shape[3]), a.dtype)
            g[..., : a.shape[2], :] = a
            grown.append(g)
        mx.eval(grown)
        mx.synchronize()
        times.append(round(1e3 * (time.perf_counter() - t), 3))
        arrays = grown
    return arrays, times


def probe(shape: Any, rows: int) -> dict[str, Any]:
    import mlx.core as mx

    dt = getattr(mx, shape.dtype)
    dim = shape.hidden // shape.heads

    def start() -> list[Any]:
        out = [
            mx.random.normal((rows, shape.kv_heads, START, dim)).astype(dt)
            for _ in range(2 * shape.layers)
        ]
        mx.eval(out)
        return out

    result: dict[str, Any] = {}
    for name in ("fresh", "cached", "after_clear"):
        if name == "after_clear":
            mx.clear_cache()
            mx.synchronize()
        arrays = start()
        grown, times = _growths(arrays, mx)
        del arrays, grown
        result[name] = times
    nbytes = rows * shape.kv_heads * dim * 2 * shape.layers * 2  # one slot of every layer's K and V
    result["bytes_per_slot"] = nbytes
    result["cache_bytes"] = int(mx.get_cache_memory())
    return result


def host_arrays(mx: Any, width: int = 4096, reps: int = 8) -> dict[str, Any]:
    """Whether making an array from host data waits for the device's queued
    work. MLX (v0.32, mlx/backend/cuda/allocator.cpp) allocates such an array
    with no stream, in unified memory, and when its buffer cache hands back a
    device buffer of that size it moves it with a synchronous cudaMemcpy
    (`move_to_unified_memory`). The worker makes a few each step (a prompt
    chunk's tokens, the decode rows' ends). Each rep queues a chain of
    matmuls (`queued_ms`, its device time, synchronised alone), then times
    making one array of `n` int32 from a list: `fresh`, and `after_device`
    right after a device array of that size was freed into the cache. Near
    `queued_ms`: the making waited for the queue."""
    x = (mx.random.normal((width, width)) / 64).astype(mx.bfloat16)
    mx.eval(x)

    def queue() -> Any:
        y = x
        for _ in range(24):
            y = y @ x
        mx.async_eval(y)
        return y

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn()
        return round(1e3 * (time.perf_counter() - t), 3)

    mx.eval(queue())
    mx.synchronize()
    out: dict[str, Any] = {"queued_ms": [timed(lambda: mx.eval(queue())) for _ in range(3)]}
    for n in (16, 256, 2048):
        values = list(range(n))
        for case in ("fresh", "after_device"):
            times = []
            for _ in range(reps):
                if case == "after_device":
                    freed = mx.arange(n, dtype=mx.int32) + 1
                    mx.eval(freed)
                    del freed
                mx.synchronize()
                pending = queue()
                times.append(timed(lambda v=values: mx.array(v, dtype=mx.int32)))
                mx.eval(pending)
            out[f"{case}/{n}"] = times
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.alloc_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--keep-freed", action="store_true")
    ap.add_argument("--host-arrays", action="store_true", help="also time host arrays")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from bench.models import SHAPES
    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA settings unless the environment sets them
    import mlx.core as mx

    from bench.cuda_pool import keep_freed, release_threshold
    from worker.runner import backend_name, device_memory_bytes

    kept = keep_freed(device_memory_bytes() or 0) if args.keep_freed else False
    result = {
        "shape": args.shape,
        "backend": backend_name(),
        "rows": args.rows,
        "keep_freed": kept,
        "release_threshold": release_threshold(),
        **probe(SHAPES[args.shape], args.rows),
    }
    if args.host_arrays:
        # a CPU's matmuls are slower by orders of magnitude: a smaller queue there
        result["host_arrays"] = host_arrays(mx, 4096 if result["backend"] == "cuda" else 256)
        for name, times in result["host_arrays"].items():
            print(f"host array {name}: median {statistics.median(times):.3f} ms, each {times}")
    del mx
    for name in ("fresh", "cached", "after_clear"):
        times = result[name]
        print(f"{name}: median {statistics.median(times):.2f} ms, each {times}")
    print(f"pool keeps freed memory: {kept} (threshold {result['release_threshold']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
