"""Launch probe: what one MLX primitive costs to evaluate, by kind.

    python -m bench.launch_probe [--chain 2000] [--reps 7] [--out probe.json]

Owns one question of issue #12 (session 22). On the H200 a step of `thin32`
(llama8b's 32 layers at a width whose matmuls cost next to nothing) took 8.2
ms to decode 16 rows against llama8b's 9.2, and a fused step with a 256-token
chunk 15 ms against 15.5-17 (`bench.pacing_probe --count-ops`): both are
bound by the primitives MLX evaluates (2,138 a decode step, 3,539 a fused
one), not by their arithmetic. Two thirds of those primitives are views
(reshape, transpose, slice, expand_dims, flatten), which launch no kernel on
CUDA; whether they cost what a kernel costs decides what a leaner step must
cut. So: for each kind, a chain of `--chain` primitives of that kind, each
on the one before (so none is dropped), on a small array, evaluated at once
and synchronised; the median of `--reps` timed rounds after one untimed
round, divided by the chain's length: microseconds a primitive to build (the
Python call and MLX's op) and to evaluate. An eval of one primitive is the
floor subtracted from the latter.

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WIDTH = 64


def _chains() -> dict[str, Callable[[Any, int], Any]]:
    """Each kind's chain: (start array, length) -> the chain's last array."""
    import mlx.core as mx

    def reshape(a: Any, n: int) -> Any:
        for i in range(n):
            a = a.reshape(-1, 2 * WIDTH) if i % 2 == 0 else a.reshape(-1, WIDTH)
        return a

    def transpose(a: Any, n: int) -> Any:
        for _ in range(n):
            a = a.T
        return a

    def slice_rows(a: Any, n: int) -> Any:
        a = mx.zeros((n + WIDTH, WIDTH), a.dtype) + a[:1]  # room to drop a row n times
        for _ in range(n):
            a = a[1:]
        return a

    def expand_squeeze(a: Any, n: int) -> Any:
        for i in range(n):
            a = a[None] if i % 2 == 0 else a[0]
        return a

    def add(a: Any, n: int) -> Any:
        one = mx.array(1.0, a.dtype)
        for _ in range(n):
            a = a + one
        return a

    def matmul(a: Any, n: int) -> Any:
        w = mx.eye(WIDTH, dtype=a.dtype)
        for _ in range(n):
            a = a @ w
        return a

    def slice_update(a: Any, n: int) -> Any:
        row = mx.ones((1, WIDTH), a.dtype)
        a = a + 0  # a copy: the writes below replace the array they are made on
        for i in range(n):
            a[i % WIDTH : i % WIDTH + 1] = row  # a SliceUpdate on the one before
        return a

    return {
        "reshape (view)": reshape,
        "transpose (view)": transpose,
        "slice (view)": slice_rows,
        "expand_dims/squeeze (view)": expand_squeeze,
        "add (kernel)": add,
        "matmul 64x64 (kernel)": matmul,
        "slice update (kernel)": slice_update,
    }


def _median_s(build: Callable[[Any, int], Any], n: int, reps: int) -> tuple[float, float]:
    """Median seconds to build a chain's graph (Python and MLX's op calls) and
    to evaluate it (synchronised)."""
    import mlx.core as mx

    start = mx.ones((WIDTH, WIDTH), mx.bfloat16)
    mx.eval(start)
    mx.eval(build(start, n))  # first use: kernels compiled, buffers allocated
    mx.synchronize()
    built, evaluated = [], []
    for _ in range(reps):
        t = time.perf_counter()
        out = build(start, n)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        built.append(t1 - t)
        evaluated.append(time.perf_counter() - t1)
    return statistics.median(built), statistics.median(evaluated)


def probe(chain: int, reps: int) -> dict[str, Any]:
    """Microseconds a primitive of each kind costs to build and to evaluate
    (the floor of an eval of one primitive subtracted), and that floor."""
    _, floor = _median_s(lambda a, n: a + 0, 0, reps)
    out: dict[str, Any] = {"chain": chain, "reps": reps, "eval_floor_us": round(1e6 * floor, 2)}
    kinds = {}
    for name, build in _chains().items():
        build_s, eval_s = _median_s(build, chain, reps)
        kinds[name] = {
            "build_us": round(1e6 * build_s / chain, 3),
            "eval_us": round(1e6 * max(0.0, eval_s - floor) / chain, 3),
        }
    out["per_primitive"] = kinds
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.launch_probe")
    ap.add_argument("--chain", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA graph mode unless MLX_USE_CUDA_GRAPHS is set
    from worker.runner import backend_name

    result = {"backend": backend_name(), **probe(args.chain, args.reps)}
    print(f"eval floor {result['eval_floor_us']} us; chains of {args.chain}:")
    for name, us in result["per_primitive"].items():
        print(f"  {name}: build {us['build_us']} us, eval {us['eval_us']} us a primitive")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
