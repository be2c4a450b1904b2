"""Build probe: the host's time to build one decode pass, and its primitives.

    python -m bench.build_probe [--shape thin32|qwen0.5b|llama8b | --model DIR]
                                [--streams 16] [--reps 300] [--out probe.json]

Owns one question session 38 raised (docs/benchmarks/README.md): on an H100
both shapes' CUDA steps are bound by the host, a third of it Python building
the pass (`fused_hidden`, each MLX op's dispatch included) and two thirds
MLX encoding and launching its primitives. This probe times the first part
alone and counts what the second is handed: mlxd's EngineCore as the worker
builds it (fused step on), `--streams` greedy requests decoding, then the
decode batch's pass (`fused_hidden` and the logits, as the lean decode step
builds it) built `--reps` times and timed up to its evaluation, which follows
untimed (each build writes one more slot into the caches, as a step
does). Prints the median and mean build time and
the pass's primitives by kind, as the worker builds it and as session 38
did (`before_*`: worker/blocks.py's `as_before`), built in alternation.
The same code builds the pass on every
backend, so a change to its Python is measured on this CPU too; only the
CUDA-only parts (the decode attention kernel, padded passes) differ.

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any


def probe(model_dir: Path, streams: int, reps: int) -> dict[str, Any]:
    """The pass built `reps` times as the worker builds it and `reps` times
    as session 38 did (worker/blocks.py, `as_before`), in alternation, so
    drift falls on both alike."""
    import mlx.core as mx

    from bench.pacing_probe import primitives_of
    from bench.step_probe import prompts
    from protocol.messages import Add, SamplingParams
    from protocol.worker_config import WorkerConfig
    from worker.blocks import as_before
    from worker.core import core_for, runner_for
    from worker.fused import fused_hidden, logits_of

    cfg = WorkerConfig(socket="", model=str(model_dir), fused_step="on")
    runner = runner_for(cfg, model_dir)
    core = core_for(cfg, runner)
    core.warmup()
    for i, prompt in enumerate(prompts(streams, varlen=False)):  # bench.step_probe's
        core.add(Add(f"stream{i}", prompt, 2_000, SamplingParams(temperature=0.0)))
    # every prompt prefilled (a stream whose greedy tokens reach EOS leaves early)
    for _ in range(10_000):
        core.step()
        if runner.active == runner.decoding:
            break
    for _ in range(8):
        core.step()
    gen = runner.generator._generation_batch
    if not gen.uids:
        raise SystemExit("no stream is decoding (every one reached EOS)")
    model, caches = runner.generator.model, gen.prompt_cache
    inputs = mx.zeros((len(gen.uids), 1), dtype=mx.int32)

    def build() -> mx.array:
        (hidden,) = fused_hidden(model, [(inputs, caches)])
        return logits_of(model, hidden)

    times: dict[str, list[float]] = {"now": [], "before": []}
    for i in range(20 + reps):
        for name, times_of in times.items():
            with nullcontext() if name == "now" else as_before():
                t = time.perf_counter()
                logits = build()
                if i >= 20:
                    times_of.append(time.perf_counter() - t)
            # Evaluated as a step's pass is (untimed): each build writes one more
            # slot into every layer's cache, and unevaluated builds would chain.
            mx.eval(logits, [c.state for c in caches])
    # with the caches' new state (offsets, written slots), which the next
    # step would read: the offsets' Adds are one a pass or one a layer
    # (worker/fused.py, `next_offsets`)
    prims = primitives_of(lambda: mx.eval(build(), [c.state for c in caches]))
    with as_before():
        prims_before = primitives_of(lambda: mx.eval(build(), [c.state for c in caches]))
    core.abort_all()
    runner.close()
    return {
        "model": str(model_dir),
        "streams": streams,
        "decoding": len(gen.uids),
        "layers": len(model.model.layers),
        "build_ms_median": round(1e3 * statistics.median(times["now"]), 4),
        "build_ms_mean": round(1e3 * statistics.fmean(times["now"]), 4),
        "before_build_ms_median": round(1e3 * statistics.median(times["before"]), 4),
        "before_build_ms_mean": round(1e3 * statistics.fmean(times["before"]), 4),
        "primitives": sum(prims.values()),
        "before_primitives": sum(prims_before.values()),
        "by_kind": prims,
        "before_by_kind": prims_before,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.build_probe")
    ap.add_argument("--shape", default="thin32")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA settings unless the environment has them
    from bench.models import shape_model

    model_dir = Path(args.model) if args.model else shape_model(args.shape)
    result = probe(model_dir, args.streams, args.reps)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("by_kind")}))
    print(json.dumps(result["by_kind"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
