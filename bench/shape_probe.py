"""Shape probe: what a backend charges the first time it meets a shape, op by op.

    python -m bench.shape_probe [--shape tiny|qwen0.5b|llama8b] [--joins-only]
                                [--out probe.json]

Owns one question of issue #12 (session 17): on the H200 the pacing probe's
second arrival of the same prompt length (`bench.pacing_probe --repeat`)
cost 25-28 ms in the steps where the first arrival's cost 41-51 ms (llama8b:
its first chunk, its finishing chunk, the step its first token came out of);
everything the second arrival met, the first had met already. This times,
with random tensors of the shape's dimensions, the first call at a new shape
and a second call at the same one, synchronised, for:

- `gemm`: the model's four projection shapes at a token count M (the rows of
  one pass: decode rows plus a prompt chunk), for several M;
- `prefill_attention`: one prompt chunk of qL tokens over kL keys, sliced
  from a cache buffer as mlx-lm's caches hand them out, with the boolean
  mask a BatchKVCache gives;
- `decode_attention`: B rows of one token over kL keys, with their mask;
- `join`: mlx-lm's BatchKVCache.extend on every layer, the decode rows
  padded to a long row's length, three times (the buffers the first one
  allocated are in MLX's cache for the others), and the worker's join that
  writes each array once (`join_one_write`, worker/batch_padding.py);
  and the decode rows in worker/decode_rows.py's layout (`decode_rows`),
  the long row copied into room the rows already had (`join_rows`, the
  room grown ahead as the layout asks while the prompt prefills) and into
  none (`join_rows_grown`: the buffers grow in the join). `--joins-only`
  times the joins alone (on a CPU the rest at llama8b's size takes long).

Each entry is (first ms, second ms). A large first against a small second is
a per-shape first use (a cuBLAS heuristic or kernel load, a cuDNN graph);
both large is work.

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GEMM_TOKENS = (17, 224, 272, 480, 528, 1040)
PREFILL = ((256, 261), (256, 517), (208, 2000), (256, 2048), (512, 2048), (512, 1024))
DECODE = ((16, 512), (17, 2048), (16, 2048))


def _twice(fn: Callable[[], Any]) -> tuple[float, float]:
    """`fn` evaluated and synchronised twice: each call's milliseconds."""
    import mlx.core as mx

    out = []
    for _ in range(2):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append(round(1e3 * (time.perf_counter() - t), 3))
    return out[0], out[1]


def probe(shape: Any, joins_only: bool = False) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask
    from mlx_lm.models.cache import BatchKVCache

    dt = getattr(mx, shape.dtype)
    width, heads, kv_heads = shape.hidden, shape.heads, shape.kv_heads
    dim = width // heads
    weights = {
        "qo": mx.random.normal((width, width)).astype(dt),
        "kv": mx.random.normal((kv_heads * dim, width)).astype(dt),
        "up": mx.random.normal((shape.intermediate, width)).astype(dt),
        "down": mx.random.normal((width, shape.intermediate)).astype(dt),
    }
    mx.eval(weights)
    result: dict[str, Any] = {"gemm": {}, "prefill_attention": {}, "decode_attention": {}}
    for m in () if joins_only else GEMM_TOKENS:
        x = mx.random.normal((1, m, width)).astype(dt)
        h = mx.random.normal((1, m, shape.intermediate)).astype(dt)
        mx.eval(x, h)

        def gemms(x: mx.array = x, h: mx.array = h) -> list[mx.array]:
            w = weights
            return [x @ w["qo"].T, x @ w["kv"].T, x @ w["up"].T, h @ w["down"].T]

        result["gemm"][m] = _twice(gemms)

    def attention(rows: int, q_len: int, k_len: int, buffer: int) -> tuple[float, float]:
        """`rows` rows of `q_len` queries over the first `k_len` keys of a
        `buffer`-long cache buffer, with the boolean mask a BatchKVCache gives."""
        q = mx.random.normal((rows, heads, q_len, dim)).astype(dt)
        kb = mx.random.normal((rows, kv_heads, buffer, dim)).astype(dt)
        pad = mx.zeros((rows,), mx.int32)
        mask = create_causal_mask(q_len, k_len - q_len, left_padding=pad)
        mx.eval(q, kb, mask)
        k = kb[..., :k_len, :]
        return _twice(
            lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=dim**-0.5, mask=mask)
        )

    for q_len, k_len in (
        () if joins_only else PREFILL
    ):  # a buffer just long enough, as a prompt's cache grows
        buffer = 256 * ((k_len + 255) // 256)
        result["prefill_attention"][f"{q_len}x{k_len}"] = attention(1, q_len, k_len, buffer)
    for rows, k_len in (
        () if joins_only else DECODE
    ):  # a decode batch's buffer has room beyond its end
        buffer = 256 * ((k_len + 256) // 256)
        result["decode_attention"][f"{rows}x{k_len}"] = attention(rows, 1, k_len, buffer)

    def layers(rows: int, length: int) -> list[BatchKVCache]:
        out = []
        for _ in range(shape.layers):
            c = BatchKVCache([0] * rows)
            k = mx.random.normal((rows, kv_heads, length, dim)).astype(dt)
            c.update_and_fetch(k, k)
            out.append(c)
        mx.eval([c.state for c in out])
        return out

    from worker.batch_padding import MLX_LM_EXTEND, one_write_extend

    for name, extend in (("join", MLX_LM_EXTEND), ("join_one_write", one_write_extend)):
        joins = []
        for _ in range(3):
            decoding, joining = layers(16, 512), layers(1, 2000)
            mx.synchronize()
            t = time.perf_counter()
            for a, b in zip(decoding, joining, strict=True):
                extend(a, b)
            mx.eval([c.state for c in decoding])
            mx.synchronize()
            joins.append(round(1e3 * (time.perf_counter() - t), 3))
            del decoding, joining
        result[name] = joins
    result.update(_rows_joins(layers))
    return result


def _rows_joins(layers: Callable[[int, int], list[Any]]) -> dict[str, list[float]]:
    """The same join with the decode rows in worker/decode_rows.py's layout:
    into 20 rows of 2,304 slots grown before it (`join_rows`) and into
    buffers just big enough for the 16 rows (`join_rows_grown`)."""
    import mlx.core as mx

    from worker import decode_rows

    def rows(n: int, length: int, room: tuple[int, int] | None) -> list[Any]:
        out = decode_rows.as_rows(layers(n, length), [0] * n)
        assert out is not None
        if room is not None:
            for c in out:
                c.fit(*room)
            mx.eval([c.state for c in out])
        return out

    result = {}
    for name, room in (("join_rows", (20, 2304)), ("join_rows_grown", None)):
        joins = []
        for _ in range(3):
            decoding, joining = rows(16, 512, room), rows(1, 2000, None)
            mx.synchronize()
            t = time.perf_counter()
            decode_rows.join(decoding, joining)
            mx.eval([c.state for c in decoding])
            mx.synchronize()
            joins.append(round(1e3 * (time.perf_counter() - t), 3))
            del decoding, joining
        result[name] = joins
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.shape_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--joins-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from bench.models import SHAPES
    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA settings unless the environment sets them
    from worker.runner import backend_name

    result = {
        "shape": args.shape,
        "backend": backend_name(),
        **probe(SHAPES[args.shape], args.joins_only),
    }
    for key in ("gemm", "prefill_attention", "decode_attention"):
        for name, (first, second) in result[key].items():
            print(f"{key} {name}: first {first} ms, second {second} ms")
    print(f"join (16 rows at 512 + one at 2,000, every layer): {result['join']} ms")
    print(f"join as one write per array: {result['join_one_write']} ms")
    print(f"join into the rows layout's room: {result['join_rows']} ms")
    print(f"join into the rows layout, grown: {result['join_rows_grown']} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
