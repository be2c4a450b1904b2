"""Variant probe: one engine's steps under several step variants, interleaved step by step.

    python -m bench.variant_probe [--shape thin32|llama8b|qwen0.5b | --model DIR]
                                  [--streams 16] [--rounds 40] [--prompt 2000]
                                  [--chunk 256] [--variants base,...,buffers,rotary,attention]
                                  [--out probe.json]

Owns the A/B of a change to the worker's step that keeps its tokens: on the
H200 one process's steady decode step drifted between about 8 and 16 ms
within minutes (sessions 7, 22 and 23), more than the changes being
measured, so variants run in alternate steps of one EngineCore over one
Runner (fused step on) and the drift falls on all of them alike. A round is
one step of each variant, the order rotated from round to round so none
always follows the same one. Variants:

- `base`: the decode rows through the model's own forward, projections
  unjoined (worker/fused.py before `lean_decode`);
- `lean`: decode passes through `fused_hidden` (`lean_decode`), unjoined;
- `joined`: `lean` with joined projections (worker/joined.py), q and k
  rotated apart (the worker's default where steps were fused, session 23);
- `rope`: `joined` with q and k rotated as one (`qk_v`; the worker's default
  from session 24 to 38);
- `nodes`: `rope` in fewer graph nodes, weights transposed once and the
  residuals added in the GEMMs (worker/blocks.py; the worker's default
  in session 39);
- `buffers`: `nodes` with the decode rows' caches written in place, read
  whole by the CUDA decode kernel, one offset array a step for every layer
  (worker/fused.py, `buffer_decode`; where the kernel is not in place, the
  same as `nodes`);
- `rotary`: `buffers` with the decode rows' heads made and q and k rotated
  by one CUDA kernel (worker/decode_rotary.py; where it is not in place,
  the same as `buffers`). The worker's default in sessions 40 and 41; off
  since session 42 (`decode_rotary`), which leaves `buffers`;
- `attention`: `buffers` with a prompt chunk's attention in five graph
  nodes (worker/prompt_attention.py; the worker's default since session
  44). Every other variant runs MLX's fallback for it, as before.

A fused step (a prompt chunk beside the decode rows) runs `fused_hidden`
whatever `lean` says; only `joined` and `rope` change it. With `--prompt`, a new long
prompt (one new token) arrives whenever the last one finished, at a forced
`--chunk`, in `--rounds` more rounds after the decode-only ones, so both
kinds of step are measured; each step's time (synchronised:
its own work, host and device) goes to its kind (decode, or fused when it
carried prompt tokens) and variant. Prints each pair's median step and the
median of the per-round ratios against the first variant.

Fused steps are compared at the same place in their prompt, not by round: a
prompt's steps cost more as its KV grows, and with rounds in a fixed rotation
a prompt of 9 steps (8 chunks and the step it joins in) under 3 variants gave
every variant the same places in every prompt (session 42's H100 run: `nodes`
always took chunks 1, 6 and 8, `buffers` 2, 4 and the join, `rotary` 3, 5
and 7). So the fused rounds run the variants in a seeded random order, and a
variant's fused ratio is the median over places of its median step there
over the first variant's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

VARIANTS = ("base", "lean", "joined", "rope", "nodes", "buffers", "rotary", "attention")


def _apply(runner: Any, variant: str) -> AbstractContextManager[Any]:
    """Set the runner's step to `variant` for the next step."""
    from worker import decode_rotary, fused, prompt_attention
    from worker.blocks import as_before
    from worker.joined import separate_rope, suspended

    runner.generator.lean = variant != "base"
    if variant == "rotary":
        return _set(prompt_attention, "enabled", False)
    stack = ExitStack()
    stack.enter_context(_set(decode_rotary, "suspended", True))
    if variant == "attention":
        stack.enter_context(_set(prompt_attention, "enabled", True))
        return stack
    stack.enter_context(_set(prompt_attention, "enabled", False))
    if variant == "buffers":
        return stack
    stack.enter_context(_set(fused, "buffer_decode", False))
    if variant == "nodes":
        return stack
    stack.enter_context(as_before())
    if variant != "rope":
        stack.enter_context(separate_rope() if variant == "joined" else suspended())
    return stack


@contextmanager
def _set(module: Any, name: str, value: bool) -> Iterator[None]:
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def _timed(core: Any, runner: Any, variant: str) -> tuple[float, int]:
    import mlx.core as mx

    with _apply(runner, variant):
        t = time.perf_counter()
        core.step()
        mx.synchronize()
        seconds = time.perf_counter() - t
    return seconds, core.step_log[-1][3]


def probe(
    runner: Any, streams: int, rounds: int, prompt_len: int, chunk: int, variants: list[str]
) -> dict[str, Any]:
    from protocol.messages import Add, SamplingParams
    from protocol.worker_config import WorkerConfig
    from worker import decode_attention, decode_rotary
    from worker.core import EngineCore, scheduler_config
    from worker.runner import backend_name

    core = EngineCore(
        runner,
        scheduler_config(WorkerConfig(socket="", model=""), backend_name()),
        memory_budget_bytes=64 << 30,
        prefix_cache_bytes=0,
    )
    core.warmup(calibrate_s=0.5)
    vocab = runner.info.vocab_size
    greedy = SamplingParams(temperature=0.0)
    room = runner.info.context_length - 64
    for i in range(streams):
        core.add(Add(f"s{i}", [(5 * i + j) % vocab for j in range(32)], room, greedy))
    for variant in variants * 4:  # each variant's first step: its first use
        _timed(core, runner, variant)
    if runner.decoding != streams:
        raise RuntimeError(f"{runner.decoding} of {streams} streams decode: {core.stats()}")
    core._forced_chunk = chunk or None
    times: dict[str, dict[str, list[float]]] = {"decode": {}, "fused": {}}
    by_round: list[dict[str, dict[str, float]]] = []
    by_place: dict[str, dict[int, list[float]]] = {}  # fused steps: variant -> place -> ms
    arrivals = place = 0
    shuffle = random.Random(0)
    for phase in ("decode", "fused") if prompt_len else ("decode",):
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            if phase == "fused":
                order = shuffle.sample(variants, len(variants))  # module doc: no aliasing
            seen: dict[str, dict[str, float]] = {}
            for variant in order:
                if phase == "fused" and not any(n.startswith("long") for n in core.requests):
                    prompt = [(13 * j + 11 + arrivals) % vocab for j in range(prompt_len)]
                    core.add(Add(f"long{arrivals}", prompt, 1, greedy))
                    arrivals += 1
                    place = 0
                seconds, prompt_tokens = _timed(core, runner, variant)
                kind = "fused" if prompt_tokens else "decode"
                times[kind].setdefault(variant, []).append(1e3 * seconds)
                seen.setdefault(kind, {})[variant] = 1e3 * seconds
                if kind == "fused":
                    by_place.setdefault(variant, {}).setdefault(place, []).append(1e3 * seconds)
                place += 1
            by_round.append(seen)
    runner.generator.lean = True
    core.abort_all()
    while core.has_work():
        core.step()
    return {
        "streams": streams,
        "rounds": rounds,
        "prompt": prompt_len,
        "chunk": chunk,
        "variants": variants,
        # which CUDA kernels the runner put in place (each passed its check)
        "decode_attention": decode_attention.takes_buffers(),
        "decode_rotary": decode_rotary.enabled(),
        "arrivals": arrivals,
        "summary": _summary(times, by_round, by_place, variants),
        "steps_ms": {
            k: {v: [round(x, 3) for x in xs] for v, xs in d.items()} for k, d in times.items()
        },
    }


def _summary(
    times: dict[str, dict[str, list[float]]],
    by_round: list[dict[str, dict[str, float]]],
    by_place: dict[str, dict[int, list[float]]],
    variants: list[str],
) -> dict[str, dict[str, Any]]:
    """Per kind and variant: steps, median ms, and the ratio to the first
    variant: for decode steps the median of the ratios over rounds in which
    both ran one, for fused steps the median over the places in a prompt
    where both ran one of the ratio of their medians there (module doc)."""
    first = variants[0]
    out: dict[str, dict[str, Any]] = {}
    for kind, per in times.items():
        for variant, xs in per.items():
            if kind == "fused":
                mine, base = by_place.get(variant, {}), by_place.get(first, {})
                ratios = [
                    statistics.median(mine[p]) / statistics.median(base[p])
                    for p in sorted(set(mine) & set(base))
                ]
                paired = {"matched_places": len(ratios)}
            else:
                ratios = [
                    seen[kind][variant] / seen[kind][first]
                    for seen in by_round
                    if variant in seen.get(kind, {}) and first in seen.get(kind, {})
                ]
                paired = {"paired_rounds": len(ratios)}
            out.setdefault(kind, {})[variant] = {
                "steps": len(xs),
                "median_ms": round(statistics.median(xs), 3),
                f"ratio_to_{first}": round(statistics.median(ratios), 4) if ratios else None,
                **paired,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.variant_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=0, help="a long prompt's tokens (0: none)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if not variants or not set(variants) <= set(VARIANTS):
        ap.error(f"--variants: a comma-separated list of {', '.join(VARIANTS)}")

    from worker.backend import apply_env

    apply_env("auto")
    from bench.models import shape_model
    from worker.backend import profile
    from worker.runner import Runner, backend_name

    backend = profile(backend_name())
    model_dir = Path(args.model) if args.model else shape_model(args.shape)
    runner = Runner(
        model_dir,
        max_batch=32,
        prefill_batch=8,
        prefill_chunk=2048,
        fused=True,
        pad_rows=backend.pad_rows,
        ragged_decode=backend.ragged_decode,
        decode_rotary=True,  # the `rotary` variant's kernel; the others suspend it
    )
    try:
        result = probe(runner, args.streams, args.rounds, args.prompt, args.chunk, variants)
    finally:
        runner.close()
    result.update(model=str(model_dir), backend=backend_name(), joined=runner.generator.joined)
    for kind, per in result["summary"].items():
        for variant, row in per.items():
            print(f"{kind} {variant}: {row}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
