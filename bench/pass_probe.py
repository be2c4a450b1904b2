"""Pass probe: what one forward pass costs, split into building its graph and running it.

    python -m bench.pass_probe [--shape tiny|qwen0.5b|llama8b | --model DIR]
                               [--reps 8] [--out probe.json]

Owns one question of issue #12: on the H200 a prompt pass costs about as much
at 70 tokens as at 2,000 (a warm shared-prefix turn against a cold one), and
two to three decode steps at 64 tokens. This times single passes of the
model, in-process, at warm shapes (each shape runs once untimed first):

- `decode`: B rows of one token over a KV cache of K tokens (mlx-lm's
  BatchKVCache, as the decode batch holds it);
- `prompt`: one row of T tokens over a cache of K tokens (KVCache, as a
  prompt chunk after a prefix-cache hit, or K=0 for a cold prompt).

For each it reports the median over `--reps` of the host's graph building
(the model call, which is lazy), the whole pass to its evaluation, and their
difference, the device's share as the host waits for it. Each rep starts
from the same cache state (the pass's own tokens dropped again), so K is
fixed. Then `pipelined`: decode steps in a loop that queues step n+1 before
reading step n back (as mlx-lm's GenerationBatch does); its per-step time
against the synchronous pass says how much of a step the overlap hides.

- `engine`: one row of T tokens over K cached, as mlxd's worker runs a
  prompt chunk on CUDA (session 19): a BatchKVCache, worker/fused.py's
  padded pass (`fused_hidden` with `pad_rows`: rows padded to `pass_rows`,
  the chunk's attention over the cache buffer's padded length with the
  mask a BatchKVCache gives) and the logits at the last position. On the
  H200 (session 18's preset, the worker's step trace) a 2,016-token prompt
  took 34 ms for its first 1,024 tokens and 73.5 for the other 991 over
  them, where `prompt` put a whole 2,000-token pass at 73: this says how
  much of that is the engine's attention (MLX's unfused path with an array
  mask; cuDNN's is off by default, worker/backend.py). Each also reports
  its first pass (`first_ms`: the shape's first use). Run it twice, with
  `MLX_CUDA_USE_CUDNN_SDPA=0` and `=1`, to compare the two attentions.

Then `join` (session 10): what it costs when a prefilled prompt joins the
decode batch, as mlx-lm's GenerationBatch.extend does it (BatchKVCache.extend
on every layer: pads and concatenations), alone and with the decode pass
that follows over the grown batch. On the H200 a paced step in which a prompt
finished cost 28-31 ms against a 7 ms decode step and an 11 ms 1,024-token
pass (session 9's pacing probe, this probe): the join is the suspect.

MLX's CUDA settings are mlxd's (worker/backend.py) unless the environment
sets them: run it twice, with `MLX_USE_CUDA_GRAPHS=0` and `=1`, to compare.

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

DECODE = ((1, 512), (8, 512), (64, 512), (8, 2048))  # (rows, KV length)
PROMPT = ((16, 0), (64, 0), (256, 0), (1024, 0), (2000, 0), (64, 2000), (256, 2000))
ENGINE = ((64, 0), (256, 0), (1024, 0), (2016, 0), (991, 1025), (73, 2016), (512, 1536))
JOIN = ((8, 512, 64), (8, 512, 1024), (32, 512, 1024))  # (decode rows, their KV, prompt)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _filled(make: Any, model: Any, rows: int, kv: int) -> list[Any]:
    import mlx.core as mx

    cache = make()
    if kv:
        model(mx.zeros((rows, kv), dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _time_pass(
    model: Any, cache: list[Any], tokens: Any, reps: int, run: Any = None
) -> dict[str, float]:
    """Median build, total and device ms of `reps` passes from the same cache
    state, and the first pass's total; `run(tokens, cache)` builds a pass (the
    model's own call by default)."""
    import mlx.core as mx

    run = run or (lambda t, c: model(t, cache=c))
    saved = [c.state for c in cache]
    builds, totals, first = [], [], 0.0
    for rep in range(reps + 1):
        for c, s in zip(cache, saved, strict=True):
            c.state = s
        mx.synchronize()
        start = time.perf_counter()
        logits = run(tokens, cache)
        built = time.perf_counter()
        mx.eval(logits, [c.state for c in cache])
        done = time.perf_counter()
        if rep:
            builds.append(built - start)
            totals.append(done - start)
        else:  # the first meets this shape (kernels, plans, allocations)
            first = done - start
    build, total = statistics.median(builds), statistics.median(totals)
    return {
        "build_ms": _ms(build),
        "total_ms": _ms(total),
        "device_ms": _ms(total - build),
        "first_ms": _ms(first),
    }


def _engine_pass(model: Any) -> Any:
    """A prompt chunk's pass as the worker runs it on CUDA (`engine` above)."""
    from worker.fused import _logits_at, fused_hidden

    def run(tokens: Any, cache: list[Any]) -> Any:
        (hidden,) = fused_hidden(model, [(tokens, cache)], pad_rows=True)
        return _logits_at(model, hidden, [(0, int(tokens.shape[1]) - 1)])

    return run


def _pipelined(model: Any, rows: int, kv: int, steps: int) -> float:
    """Per-step ms of `steps` decode steps, each queued before the last is read."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    layers = len(model.layers)
    cache = _filled(lambda: [BatchKVCache([0] * rows) for _ in range(layers)], model, rows, kv)
    y = mx.zeros((rows,), dtype=mx.int32)

    def step(inputs: mx.array) -> mx.array:
        out = mx.argmax(model(inputs[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(out)
        return out

    y = step(y)
    mx.eval(y)
    start = time.perf_counter()
    for _ in range(steps):
        nxt = step(y)
        y.tolist()  # the step before, as mlx-lm reads it back
        y = nxt
    mx.eval(y)
    return (time.perf_counter() - start) / steps


def _time_join(model: Any, rows: int, kv: int, tokens: int, reps: int) -> dict[str, float]:
    """Median ms of joining a `tokens`-long prompt row to `rows` decode rows at
    KV `kv` (every layer's BatchKVCache.extend, evaluated), and of that join
    with the decode pass over the grown batch; each rep from the same state."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    layers = len(model.layers)
    batch = _filled(lambda: [BatchKVCache([0] * rows) for _ in range(layers)], model, rows, kv)
    joining = _filled(lambda: [BatchKVCache([0]) for _ in range(layers)], model, 1, tokens)
    saved = [c.state for c in batch]
    step = mx.zeros((rows + 1, 1), dtype=mx.int32)
    joins: list[float] = []
    with_decode: list[float] = []
    for rep in range(2 * reps + 2):
        for c, s in zip(batch, saved, strict=True):
            c.state = s
        decode = rep % 2 == 1
        mx.synchronize()
        start = time.perf_counter()
        for c, other in zip(batch, joining, strict=True):
            c.extend(other)
        out = model(step, cache=batch) if decode else None
        mx.eval(out if out is not None else [], [c.state for c in batch])
        seconds = time.perf_counter() - start
        if rep >= 2:  # the first of each compiles its shapes
            (with_decode if decode else joins).append(seconds)
    return {
        "join_ms": _ms(statistics.median(joins)),
        "join_decode_ms": _ms(statistics.median(with_decode)),
    }


def probe(
    model_dir: Path,
    reps: int,
    decode: tuple[tuple[int, int], ...] = DECODE,
    prompt: tuple[tuple[int, int], ...] = PROMPT,
    join: tuple[tuple[int, int, int], ...] = JOIN,
    engine: tuple[tuple[int, int], ...] = ENGINE,
) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache, KVCache

    model = load(str(model_dir))[0]
    layers = len(model.layers)
    rows_out: list[dict[str, Any]] = []
    for rows, kv in decode:
        cache = _filled(
            lambda r=rows: [BatchKVCache([0] * r) for _ in range(layers)], model, rows, kv
        )
        r = _time_pass(model, cache, mx.zeros((rows, 1), dtype=mx.int32), reps)
        rows_out.append({"kind": "decode", "rows": rows, "tokens": 1, "kv": kv, **r})
    for tokens, kv in prompt:
        cache = _filled(lambda: [KVCache() for _ in range(layers)], model, 1, kv)
        r = _time_pass(model, cache, mx.zeros((1, tokens), dtype=mx.int32), reps)
        rows_out.append({"kind": "prompt", "rows": 1, "tokens": tokens, "kv": kv, **r})
    for tokens, kv in engine:
        cache = _filled(lambda: [BatchKVCache([0]) for _ in range(layers)], model, 1, kv)
        x = mx.zeros((1, tokens), dtype=mx.int32)
        r = _time_pass(model, cache, x, reps, _engine_pass(model))
        rows_out.append({"kind": "engine", "rows": 1, "tokens": tokens, "kv": kv, **r})
    pipelined = [
        {"rows": rows, "kv": kv, "step_ms": _ms(_pipelined(model, rows, kv, 4 * reps))}
        for rows, kv in decode
        if kv == decode[0][1]
    ]
    joins = [
        {"rows": rows, "kv": kv, "tokens": tokens, **_time_join(model, rows, kv, tokens, reps)}
        for rows, kv, tokens in join
    ]
    return {"passes": rows_out, "pipelined": pipelined, "join": joins}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pass_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import os

    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA settings unless the environment sets them
    from bench.models import shape_model
    from worker.runner import backend_name

    model_dir = Path(args.model) if args.model else shape_model(args.shape)
    result = {
        "model": str(model_dir),
        "backend": backend_name(),
        "cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "(MLX default)"),
        "cudnn_sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "(MLX default)"),
        **probe(model_dir, max(1, args.reps)),
    }
    print(
        f"backend {result['backend']}, MLX_USE_CUDA_GRAPHS={result['cuda_graphs']}, "
        f"MLX_CUDA_USE_CUDNN_SDPA={result['cudnn_sdpa']}"
    )
    for p in result["passes"]:
        print(
            f"{p['kind']:6s} rows {p['rows']:3d} tokens {p['tokens']:5d} kv {p['kv']:5d}: "
            f"build {p['build_ms']:7.3f} ms, total {p['total_ms']:7.3f} ms, "
            f"device {p['device_ms']:7.3f} ms; first {p['first_ms']:7.3f} ms",
            flush=True,
        )
    for p in result["pipelined"]:
        print(f"pipelined decode rows {p['rows']:3d} kv {p['kv']:5d}: {p['step_ms']:.3f} ms/step")
    for p in result["join"]:
        print(
            f"join a {p['tokens']:5d}-token row to {p['rows']:3d} rows at kv {p['kv']:5d}: "
            f"{p['join_ms']:.3f} ms, with the decode pass after it {p['join_decode_ms']:.3f} ms"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
