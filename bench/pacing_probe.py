"""Pacing probe: a long prompt joining decoding streams, in-process, with and without calibration.

    python -m bench.pacing_probe [--shape tiny|qwen0.5b|llama8b | --model DIR]
                                 [--streams 4] [--prompt 1024] [--calibrate-s 1.0]
                                 [--fused off|on|both] [--profile] [--out probe.json]

Owns one measurement the full benchmark also makes (its `mixed_pressure`
scenario), without a server, so it fits a short GPU session: mlxd's EngineCore
on one Runner, `--streams` greedy streams decoding, then a `--prompt`-token
prompt arrives; it records every step's duration and prompt tokens from the
stream's view, the prompt's TTFT, and the same prompt's TTFT on an idle core.
It runs twice on fresh cores: warm-up without pacing calibration (the first
long prompt explores chunk sizes) and with it (`EngineCore.warmup`). Timings
are `time.perf_counter()` around `core.step()`; the GPU work of a step is
complete when it returns (its tokens reached the host). `--fused` picks the
runner's step: two passes (mlx-lm's), one fused pass (worker/fused.py), or
both in turn on the same process.

`--profile` (session 10): a cProfile of the slowest step while the prompt
is paced and of a steady step, the functions with the most time of their
own first. On the H200 the step in which a paced prompt finished cost 28-31
ms against a 7 ms decode step, a 1,024-token pass of 8-11 ms and a join of
2-3 ms (bench.pass_probe): the profile says where the rest goes, in
particular which calls wait for the device (`tolist`, `item`, `eval`).

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _profiled(core: Any, profile: bool) -> tuple[float, str]:
    """One core.step(): its seconds, and with `profile` its cProfile as text."""
    if not profile:
        t = time.perf_counter()
        core.step()
        return time.perf_counter() - t, ""
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    core.step()
    prof.disable()
    seconds = time.perf_counter() - t
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(PROFILE_LINES)
    return seconds, out.getvalue()


PROFILE_LINES = 25


def _probe(
    runner: Any, calibrate_s: float, streams: int, prompt_len: int, profile: bool = False
) -> dict[str, Any]:
    from protocol.messages import Add, SamplingParams
    from protocol.worker_config import WorkerConfig
    from worker.core import EngineCore, scheduler_config
    from worker.runner import backend_name

    core = EngineCore(
        runner,  # the worker's scheduler defaults for this backend
        scheduler_config(WorkerConfig(socket="", model=""), backend_name()),
        memory_budget_bytes=64 << 30,
        prefix_cache_bytes=0,  # every run prefills the whole prompt
    )
    t = time.perf_counter()
    core.warmup(calibrate_s=calibrate_s)
    warmup_s = time.perf_counter() - t
    learned = list(core.scheduler.cost.predict_coef()) if core.scheduler.cost.ready else []
    vocab = runner.info.vocab_size
    greedy = SamplingParams(temperature=0.0)
    long_prompt = [(13 * j + 7) % vocab for j in range(prompt_len)]

    core.add(Add("idle", long_prompt, 1, greedy))
    t = time.perf_counter()
    while core.has_work():
        core.step()
    idle_ttft = time.perf_counter() - t

    room = runner.info.context_length - 64  # as many tokens as the context allows
    for i in range(streams):
        core.add(Add(f"s{i}", [(5 * i + j) % vocab for j in range(32)], room, greedy))
    for _ in range(10):
        core.step()
    if runner.decoding != streams:
        raise RuntimeError(f"{runner.decoding} of {streams} streams decode: {core.stats()}")
    steady = []
    for _ in range(20):
        t = time.perf_counter()
        core.step()
        steady.append(time.perf_counter() - t)
    steady_profile = _profiled(core, profile)[1]
    core.add(Add("long", [(13 * j + 11) % vocab for j in range(prompt_len)], 1, greedy))
    t_add = time.perf_counter()
    steps: list[tuple[float, int]] = []
    slowest = (0.0, "")
    while "long" in core.requests:
        seconds, text = _profiled(core, profile)
        steps.append((seconds, core.step_log[-1][3]))
        slowest = max(slowest, (seconds, text))
    ttft = time.perf_counter() - t_add
    core.abort_all()
    while core.has_work():
        core.step()
    gaps = [s for s, _ in steps]
    return {
        "calibrate_s": calibrate_s,
        "warmup_s": round(warmup_s, 3),
        # the cost model's coefficients (a, b, c, d) when the prompt came; [] unfitted
        "warmup_cost_model": learned,
        "steady_step_ms": round(1e3 * statistics.median(steady), 3),
        "paced_steps": len(steps),
        "max_step_ms": round(1e3 * max(gaps), 3),
        "median_step_ms": round(1e3 * statistics.median(gaps), 3),
        "long_ttft_ms": round(1e3 * ttft, 3),
        "idle_ttft_ms": round(1e3 * idle_ttft, 3),
        "steps": [(round(1e3 * s, 3), p) for s, p in steps],
        # cProfile text (--profile; else ""): the slowest paced step, a steady one
        "profile_slowest": slowest[1],
        "profile_steady": steady_profile,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pacing_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--calibrate-s", type=float, default=1.0)
    ap.add_argument("--fused", choices=("off", "on", "both"), default="off")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA graph mode unless MLX_USE_CUDA_GRAPHS is set
    from bench.models import shape_model
    from worker.runner import Runner, backend_name

    model_dir = Path(args.model) if args.model else shape_model(args.shape)
    result: dict[str, Any] = {"model": str(model_dir), "backend": backend_name(), "runs": []}
    modes = ("off", "on") if args.fused == "both" else (args.fused,)
    for mode in modes:
        runner = Runner(
            model_dir, max_batch=32, prefill_batch=8, prefill_chunk=2048, fused=mode == "on"
        )
        for calibrate_s in (0.0, args.calibrate_s):
            run = {
                "fused": runner.fused,
                **_probe(runner, calibrate_s, args.streams, args.prompt, args.profile),
            }
            result["runs"].append(run)
            print(
                f"fused {runner.fused}, calibrate {calibrate_s:g}s: warm-up {run['warmup_s']}s; "
                f"steady step {run['steady_step_ms']} ms; {run['paced_steps']} paced steps, "
                f"max {run['max_step_ms']} ms, median {run['median_step_ms']} ms; long TTFT "
                f"{run['long_ttft_ms']} ms vs idle {run['idle_ttft_ms']} ms; first steps "
                f"{run['steps'][:6]}",
                flush=True,
            )
            if args.profile:
                print(f"-- the slowest paced step\n{run['profile_slowest']}")
                print(f"-- a steady step\n{run['profile_steady']}", flush=True)
        runner.close()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
