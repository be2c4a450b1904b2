"""Admission probe: what a paced step that admits a prompt costs beyond its pass.

    python -m bench.admit_probe [--shape tiny|qwen0.5b|llama8b | --model DIR]
                                [--streams 16] [--prompts 256,2000] [--reps 6]
                                [--chunk 256] [--decode-rows auto|on|off]
                                [--out probe.json]

Owns one question the step traces raise (sessions 31-32, docs/benchmarks/
README.md): on both GPU shapes the paced step that admits a prompt beside
decoding streams takes 7-10 ms more than the paced steps after it (llama8b
on an H100: 26.8 ms for its 256 tokens against a median 13.4-13.9 ms for
the next ones), and that step is the streams' p99 gap under mixed pressure.

mlxd's EngineCore as the worker builds it (`core_for`, the worker's warm-up),
`--streams` greedy requests decoding, then for each prompt length, `--reps`
times: one prompt added and stepped until it decodes, every one of its steps
carrying `--chunk` tokens (the warm-up calibration's forced chunk; 0: the
planner's), so the admitting step has steps of its own size to compare with
(session 32's first run let the planner choose, and the 2,000-token prompt
went in one step). Per step it records the wall time and, in the `phases`
pass, each stage of the fused generator timed
with the device synchronised at its ends (`_admit`: the prompt batch's
creation; `_cut_chunks`: the chunk and its KV reservation; `_fused`: the one
pass; `_started`: the finished prompt made a decode batch; `_join`: that
batch joined to the decode rows, its caches evaluated, which serving leaves
lazy for the next step's pass), so the stage that carries the admission's
excess shows, and the joining step (session 34, llama8b on an H100:
27.4-28.0 ms after a 2,000-token prompt against 6.4-7.0 for the decode step
after it) splits: its join lands in the step before, so in this pass the
joining step holds its decode pass alone. Passes:
`default` (pipelined, as served), `phases` (synchronised stages; every
step also times its runner step, the decode batch's next() and its pass
within it, and the prefix cache's insert), `host` (the same stages timed
on the host alone, the device left pipelined as served: a stage that
waits for the device where serving expects none, a hidden
synchronisation, shows as a long one; the only wait a step should hold is
the read-back of the previous step's tokens in its pass; `_wait` sums
every blocking `mx.eval` of the step),
`no_reserve` (pipelined, the prompt's KV grown 256 slots at a time instead of
reserved whole at admission, worker/batch_padding.py `reserve`). Each
summary holds the medians of the admitting step, the paced steps after it,
the joining step (the first after the last paced one) and the decode step
after that, and each step's memory (`peak_mib`: the allocator's peak above
what was live before it, so a step that copies the decode batch's KV peaks
by that size; `grew_mib`: what stayed live). `--decode-rows` sets the
engine's `decode_rows` (the decode batch's KV layout,
worker/decode_rows.py), for an A/B of the joining step.

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PASSES = ("default", "phases", "no_reserve", "host")
STAGES = ("_admit", "_cut_chunks", "_fused", "_started")
JOIN = "_join"  # the decode batch's extend (worker/fused.py `_Batch`), timed apart
# Every step's own parts in the `phases` and `host` passes: the runner's whole
# step, the decode batch's next() and its pass within it (mlx-lm's
# GenerationBatch._step: the pass queued, the previous tokens read back), the
# prefix cache's insert.
PARTS = ("_runner", "_next", "_pass", "_prefix")
# Per step, MiB: the allocator's peak above what was live before it, and what
# stayed live after it.
MEMORY = ("peak_mib", "grew_mib")
WAIT = "_wait"  # the `host` pass: every blocking mx.eval of the step (the host's waits)


def _timed(
    fn: Callable[..., Any], into: dict[str, float], name: str, sync: bool = True
) -> Callable[..., Any]:
    """`fn` timed into `into[name]`; `sync`: with the device synchronised at
    both ends (else the host's time alone, the device left pipelined)."""
    import mlx.core as mx

    def wrapper(*args: Any, **kw: Any) -> Any:
        if sync:
            mx.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kw)
        if sync:
            mx.synchronize()  # every stage launches what it builds (async_eval)
        into[name] = into.get(name, 0.0) + time.perf_counter() - t
        return out

    return wrapper


def _evaluated(extend: Callable[..., Any]) -> Callable[..., Any]:
    """`_Batch.extend` with the joined caches computed before it returns (served,
    they stay lazy until the next step's pass reads them)."""
    import mlx.core as mx

    def wrapper(self: Any, batch: Any) -> None:
        extend(self, batch)
        mx.eval([c.state for c in self.prompt_cache])

    return wrapper


def _admissions(core: Any, pass_name: str, length: int, reps: int, vocab: int) -> list[dict]:
    import mlx.core as mx

    from protocol.messages import Add, SamplingParams
    from worker.fused import _Batch

    gen = core.runner.generator
    extend, batch_next, batch_step = _Batch.extend, _Batch.next, _Batch._step
    evaluate = mx.eval
    saved = {name: getattr(gen, name) for name in STAGES}
    stages: dict[str, float] = {}
    if pass_name in ("phases", "host"):
        sync = pass_name == "phases"
        for name in STAGES:
            setattr(gen, name, _timed(saved[name], stages, name, sync))
        join = _evaluated(extend) if sync else extend
        setattr(_Batch, "extend", _timed(join, stages, JOIN, sync))  # noqa: B010
        setattr(_Batch, "next", _timed(batch_next, stages, "_next", sync))  # noqa: B010
        setattr(_Batch, "_step", _timed(batch_step, stages, "_pass", sync))  # noqa: B010
        core.runner.step = _timed(core.runner.step, stages, "_runner", sync)
        core.prefix_cache.insert = _timed(core.prefix_cache.insert, stages, "_prefix", sync)
        if not sync:
            mx.eval = _timed(evaluate, stages, WAIT, sync=False)
    if pass_name == "no_reserve":
        gen._reserve_prompt_kv = lambda: None
    rows = []
    try:
        for rep in range(reps):
            rid = f"{pass_name}-{length}-{rep}"
            # unique to the pass too: a prompt seen before would be a prefix-cache hit
            salt = 1000 * PASSES.index(pass_name) + 7 * rep + length
            prompt = [(31 * j + salt) % vocab for j in range(length)]
            core.add(Add(rid, prompt, 2, SamplingParams(temperature=0.0)))
            steps = []
            while rid in core.requests:
                stages.clear()
                active = mx.get_active_memory()
                t = time.perf_counter()
                core.step()
                log = core.step_log[-1]
                steps.append(
                    {
                        "ms": round(1e3 * (time.perf_counter() - t), 3),
                        "prompt_tokens": int(log[3]),
                        # the runner resets the peak at its step's start: a step
                        # that copies the decode batch's KV peaks by its size
                        "peak_mib": round((mx.get_peak_memory() - active) / 2**20, 1),
                        "grew_mib": round((mx.get_active_memory() - active) / 2**20, 1),
                        **{k: round(1e3 * v, 3) for k, v in stages.items()},
                    }
                )
            rows.append({"rep": rep, "steps": steps})
    finally:
        for name, fn in saved.items():
            setattr(gen, name, fn)
        setattr(_Batch, "extend", extend)  # noqa: B010
        setattr(_Batch, "next", batch_next)  # noqa: B010
        setattr(_Batch, "_step", batch_step)  # noqa: B010
        mx.eval = evaluate
        core.runner.__dict__.pop("step", None)
        core.prefix_cache.__dict__.pop("insert", None)
        gen.__dict__.pop("_reserve_prompt_kv", None)
    return rows


def _summary(rows: list[dict]) -> dict[str, Any]:
    """Medians over the reps: the admitting step (the first with prompt
    tokens), the paced steps after it, the joining step (the first after the
    last paced one: its pass is the first over the joined rows) and the step
    after that (a decode step)."""
    first: list[dict] = []
    later: list[dict] = []
    joining: list[dict] = []
    after: list[dict] = []
    for r in rows:
        steps = r["steps"]
        paced = [i for i, s in enumerate(steps) if s["prompt_tokens"] > 0]
        if paced:
            first.append(steps[paced[0]])
            later.extend(steps[i] for i in paced[1:])
            joining.extend(steps[paced[-1] + 1 : paced[-1] + 2])
            after.extend(steps[paced[-1] + 2 : paced[-1] + 3])

    def med(steps: list[dict], key: str) -> float | None:
        vals = [s[key] for s in steps if key in s]
        return round(statistics.median(vals), 3) if vals else None

    keys = ("ms", "prompt_tokens", *MEMORY, *STAGES, JOIN, *PARTS, WAIT)
    return {
        "admitting": {k: med(first, k) for k in keys},
        "later": {k: med(later, k) for k in keys},
        "joining": {k: med(joining, k) for k in ("ms", *MEMORY, *PARTS, WAIT)},
        "after": {k: med(after, k) for k in ("ms", *MEMORY, *PARTS, WAIT)},
    }


def probe(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from protocol.messages import Add, SamplingParams
    from protocol.worker_config import WorkerConfig
    from worker.core import core_for, runner_for

    cfg = WorkerConfig(
        socket="", model=str(model_dir), fused_step=args.fused_step, decode_rows=args.decode_rows
    )
    runner = runner_for(cfg, model_dir)
    core = core_for(cfg, runner)
    warmup_s = core.warmup()
    core._forced_chunk = args.chunk or None
    vocab = max(runner.info.vocab_size, 2)
    for i in range(args.streams):
        stream = [(11 * j + i) % vocab for j in range(64)]
        core.add(Add(f"stream{i}", stream, 2_000, SamplingParams(temperature=0.0)))
    for _ in range(8):
        core.step()
    out: dict[str, Any] = {
        "model": str(model_dir),
        "warmup_s": round(warmup_s, 3),
        "fused": runner.generator.fuse,
        "padded": runner.pad_rows,
        "decode_rows": runner.generator.decode_rows,
        "chunk": args.chunk,
    }
    for pass_name in args.passes:
        for length in args.prompts:
            rows = _admissions(core, pass_name, length, args.reps, vocab)
            out[f"{pass_name}/{length}"] = {"summary": _summary(rows), "reps": rows}
    core.abort_all()
    runner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.admit_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompts", default="256,2000")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=256, help="every paced step's tokens; 0: planned")
    ap.add_argument("--fused-step", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--decode-rows", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--passes", default=",".join(PASSES), help="of " + ", ".join(PASSES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.prompts = [int(x) for x in args.prompts.split(",") if x]
    args.passes = [p for p in args.passes.split(",") if p in PASSES]

    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA settings unless the environment has them
    from bench.models import shape_model

    model_dir = Path(args.model) if args.model else shape_model(args.shape)
    result = probe(model_dir, args)
    for key, value in result.items():
        if isinstance(value, dict):
            print(key, json.dumps(value["summary"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
