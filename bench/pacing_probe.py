"""Pacing probe: a long prompt joining decoding streams, in-process, with and without calibration.

    python -m bench.pacing_probe [--shape tiny|qwen0.5b|llama8b | --model DIR]
                                 [--streams 4] [--prompt 1024] [--calibrate-s 1.0]
                                 [--fused off|on|both] [--profile] [--sync]
                                 [--long-tokens 1] [--after 3] [--calibrated-only]
                                 [--pad-rows auto|on|off] [--prompt-attention auto|on|off]
                                 [--trace DIR]
                                 [--chunk N] [--count-ops] [--join on|off|both|off,on,...]
                                 [--admission-cost default|on|off] [--out probe.json]

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
both in turn on the same process. `--join` (session 23): the fused step's
projections joined (worker/joined.py: q/k/v and gate/up as one matmul each),
not, both, or any sequence of the two (`off,on,on,off`) in turn on the same
process (each process runs at its own speed on the H200, session 22: an A/B
between processes needs many pairs).

`--profile` (session 10): cProfiles, the functions with the most time of
their own first, of a steady step, the prompt's first paced step, the
slowest, its finishing step (the one that gives its first token) and the
step after. On the H200 the step in which a paced prompt finished cost 28-31
ms against a 7 ms decode step, a 1,024-token pass of 8-11 ms and a join of
2-3 ms (bench.pass_probe): the profile says where the rest goes, in
particular which calls wait for the device (`tolist`, `item`, `eval`).

`--sync` (session 17): every step ends with `mx.synchronize()` inside its
timing, so a step's time is its own work, host and device, instead of the
device time of the pass queued one step earlier (a pipelined step waits for
that one's tokens); each step also records its host part (until `step()`
returned). `--long-tokens` lets the prompt decode on after its first token
(in mlxd's mixed pressure it does: the decode batch then carries its KV), and
`--after` steps past its first token are recorded too (`after`).
`--repeat N` sends the same length N times, one after another beside the same
streams (`repeats`): the second arrival meets only shapes the first one
already met, so a cost that is gone the second time was a first use (kernel
compilation, a cuDNN plan, an allocation the buffer cache then keeps).
`--pad-rows` (session 17): the runner's padded passes (worker/fused.py,
`pad_rows`), the backend's default (`auto`: on for CUDA) or forced;
`--prompt-attention` (session 44) likewise for worker/prompt_attention.py.
`--chunk N` (session 21): every arrival's steps at chunk N instead of the
planner's (the warm-up still plans its own), to price one chunk size beside
the streams, cold (the first arrival) and warm (the repeats): in mlxd's
standard preset llama8b's long prompt went in 128-token steps of 22-31 ms
where mlxd alone had run 256-token steps of 17-20.
`--count-ops` (session 22): after the timed arrivals, the primitives MLX
evaluates in one decode step and in each step of one more arrival, by kind
(`ops`; counted from the graphs the steps hand to `mx.eval`/`mx.async_eval`,
so timing is off while counting). On a GPU with CUDA graphs off each
primitive that computes is at least one kernel launch; `--shape thin32`
(llama8b's layers at a width whose matmuls cost next to nothing) times what
those launches and the host's work cost alone. On the CPU the counts include
the fallbacks of MLX's fused kernels (rope, RMS norm, attention), which a GPU
runs as one primitive each.
`--trace DIR`: the worker's step trace (`trace`: every step's time beside the
cost model's prediction and the chunk it planned), to see why the planner
chose a chunk (on llama8b a padded arrival's one 2,048-token step took 55 ms
against a 15 ms steady step).

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _profiled(core: Any, profile: bool, sync: bool = False) -> tuple[float, float, str]:
    """One core.step(): its seconds, the host's part of them (until step()
    returned; all of them without `sync`), and with `profile` its cProfile."""
    import mlx.core as mx

    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    core.step()
    host = time.perf_counter() - t
    if sync:
        mx.synchronize()
    if prof is not None:
        prof.disable()
    seconds = time.perf_counter() - t
    if prof is None:
        return seconds, host, ""
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(PROFILE_LINES)
    return seconds, host, out.getvalue()


PROFILE_LINES = 25


def _probe(
    runner: Any,
    calibrate_s: float,
    streams: int,
    prompt_len: int,
    profile: bool = False,
    sync: bool = False,
    long_tokens: int = 1,
    after: int = 3,
    repeat: int = 1,
    trace_dir: str = "",
    chunk: int | None = None,
    count_ops: bool = False,
    admission_cost: bool | None = None,
) -> dict[str, Any]:
    from protocol.messages import Add, SamplingParams
    from protocol.worker_config import WorkerConfig
    from worker.core import EngineCore, scheduler_config
    from worker.runner import backend_name
    from worker.step_trace import open_step_trace

    worker = WorkerConfig(socket="", model="")
    if admission_cost is not None:
        worker = dataclasses.replace(worker, admission_cost=admission_cost)
    core = EngineCore(
        runner,  # the worker's scheduler defaults for this backend
        scheduler_config(worker, backend_name()),
        memory_budget_bytes=64 << 30,
        prefix_cache_bytes=0,  # every run prefills the whole prompt
        step_trace=open_step_trace(trace_dir) if trace_dir else None,
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
        steady.append(_profiled(core, False, sync)[0])
    profiles = {"steady": _profiled(core, profile, sync)[2]}
    core._forced_chunk = chunk  # None: the planner's
    arrivals = []
    for n in range(repeat):
        prompt = [(13 * j + 11 + n) % vocab for j in range(prompt_len)]
        arrival, seen = _arrival(core, f"long{n}", prompt, long_tokens, after, profile, sync)
        arrivals.append(arrival)
        if n == 0:
            profiles.update(seen)
        for _ in range(5):  # the aborted row leaves the batch before the next arrival
            core.step()
    counted = [(13 * j + 5) % vocab for j in range(prompt_len)]
    ops = _counted_arrival(core, counted) if count_ops else {}
    core.abort_all()
    while core.has_work():
        core.step()
    trace: list[dict[str, Any]] = []
    if core.step_trace is not None:  # every step after the warm-up, with its prediction
        core.step_trace.close()
        lines = core.step_trace.path.read_text().splitlines()
        trace = [t for t in map(json.loads, lines) if not t.get("warmup")]
    first = arrivals[0]
    gaps = [s for s, _, _ in first["steps"]]
    return {
        "calibrate_s": calibrate_s,
        "warmup_s": round(warmup_s, 3),
        # the cost model's coefficients (a, b, c, d) when the prompt came; [] unfitted
        "warmup_cost_model": learned,
        "steady_step_ms": round(1e3 * statistics.median(steady), 3),
        "paced_steps": len(gaps),
        "max_step_ms": max(gaps),
        "median_step_ms": round(statistics.median(gaps), 3),
        "long_ttft_ms": first["long_ttft_ms"],
        "idle_ttft_ms": round(1e3 * idle_ttft, 3),
        "sync": sync,
        "pad_rows": runner.pad_rows,
        "chunk": chunk,
        # (ms, prompt tokens, host ms) of each step until the prompt's first
        # token, and of the `after` steps that followed
        "steps": first["steps"],
        "after": first["after"],
        # cProfile texts (--profile; else none): steady, first, slowest,
        # finishing (the step of the first token) and after
        "profiles": {k: v for k, v in profiles.items() if v},
        # --trace: the worker's step trace of every step after the warm-up
        # (worker/step_trace.py: its time, the cost model's prediction, the chunk)
        "trace": trace,
        # --repeat: the same length arriving again (its shapes now seen)
        "repeats": arrivals[1:],
        # --count-ops: primitives by kind of a decode step ("decode") and of
        # each step of one more arrival ("arrival1", ...)
        "ops": ops,
    }


def primitives_of(run: Callable[[], Any]) -> dict[str, int]:
    """The primitives, by kind, of the graphs `run()` hands to `mx.eval` and
    `mx.async_eval` (each exported to dot and its nodes counted)."""
    import io
    import re
    from collections import Counter

    import mlx.core as mx

    seen: Counter[str] = Counter()
    plain = (mx.eval, mx.async_eval)

    def arrays(tree: Any) -> list[Any]:
        if isinstance(tree, mx.array):
            return [tree]
        if isinstance(tree, (list, tuple)):
            return [a for t in tree for a in arrays(t)]
        if isinstance(tree, dict):
            return [a for t in tree.values() for a in arrays(t)]
        return []

    def counted(evaluate: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            dot = io.StringIO()
            mx.export_to_dot(dot, *arrays(args))
            seen.update(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))
            return evaluate(*args)

        return wrapped

    mx.eval, mx.async_eval = counted(plain[0]), counted(plain[1])
    try:
        run()
    finally:
        mx.eval, mx.async_eval = plain
    return dict(sorted(seen.items()))


def _counted_arrival(core: Any, prompt: list[int]) -> dict[str, dict[str, int]]:
    """The primitives, by kind, of one decode step and of every step of one
    more arrival of `prompt` until its first token (`--count-ops`)."""
    from protocol.messages import Add, SamplingParams

    ops = {"decode": primitives_of(core.step)}
    core.add(Add("counted", prompt, 1, SamplingParams(temperature=0.0)))
    long = core.requests["counted"]
    while long.first_token_at is None and "counted" in core.requests:
        ops[f"arrival{len(ops)}"] = primitives_of(core.step)
    core.abort(["counted"])
    return ops


def _arrival(
    core: Any,
    name: str,
    prompt: list[int],
    max_tokens: int,
    after: int,
    profile: bool,
    sync: bool,
) -> tuple[dict[str, Any], dict[str, str]]:
    """One long prompt arriving beside the streams: its TTFT, every step until
    its first token and `after` more as (ms, prompt tokens, host ms); and the
    cProfiles of its first, slowest, finishing and after steps. The prompt is
    aborted at the end."""
    from protocol.messages import Add, SamplingParams

    core.add(Add(name, prompt, max_tokens, SamplingParams(temperature=0.0)))
    t_add = time.perf_counter()
    steps: list[tuple[float, int, float]] = []  # (seconds, prompt tokens, host seconds)
    profiles: dict[str, str] = {}
    slowest = (0.0, "")
    long = core.requests[name]
    while long.first_token_at is None and name in core.requests:
        seconds, host, text = _profiled(core, profile, sync)
        steps.append((seconds, core.step_log[-1][3], host))
        if len(steps) == 1:
            profiles["first"] = text
        slowest = max(slowest, (seconds, text))
        profiles["finishing"] = text
    ttft = time.perf_counter() - t_add
    profiles["slowest"] = slowest[1]
    later: list[tuple[float, int, float]] = []
    for i in range(after):
        seconds, host, text = _profiled(core, profile and i == 0, sync)
        later.append((seconds, core.step_log[-1][3], host))
        if i == 0:
            profiles["after"] = text
    core.abort([name])

    def ms(rows: list[tuple[float, int, float]]) -> list[tuple[float, int, float]]:
        return [(round(1e3 * s, 3), p, round(1e3 * h, 3)) for s, p, h in rows]

    arrival = {"long_ttft_ms": round(1e3 * ttft, 3), "steps": ms(steps), "after": ms(later)}
    return arrival, profiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pacing_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--calibrate-s", type=float, default=1.0)
    ap.add_argument("--fused", choices=("off", "on", "both"), default="off")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--long-tokens", type=int, default=1)
    ap.add_argument("--after", type=int, default=3)
    ap.add_argument("--calibrated-only", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--pad-rows", choices=("auto", "on", "off"), default="auto")
    ap.add_argument(
        "--prompt-attention",
        choices=("auto", "on", "off"),
        default="auto",
        help="a chunk's attention as worker/prompt_attention.py computes it (auto: the backend's)",
    )
    ap.add_argument("--trace", default="", help="a directory for the worker's step trace")
    ap.add_argument("--chunk", type=int, help="every arrival's chunk; default: planned")
    ap.add_argument("--count-ops", action="store_true", help="primitives per step, by kind")
    ap.add_argument("--join", default="on", help="on, off, both, or a sequence: off,on,on,off")
    ap.add_argument(
        "--admission-cost",
        choices=("default", "on", "off"),
        default="default",
        help="the scheduler's admission_cost (default: the worker's)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA graph mode unless MLX_USE_CUDA_GRAPHS is set
    from bench.models import shape_model
    from worker import prompt_attention
    from worker.backend import profile, uses_prompt_attention
    from worker.runner import Runner, backend_name

    prompt_attention.enabled = uses_prompt_attention(args.prompt_attention, backend_name())

    model_dir = Path(args.model) if args.model else shape_model(args.shape)
    result: dict[str, Any] = {"model": str(model_dir), "backend": backend_name(), "runs": []}
    modes = ("off", "on") if args.fused == "both" else (args.fused,)
    joins = ("off", "on") if args.join == "both" else tuple(args.join.split(","))
    if not set(joins) <= {"on", "off"}:
        ap.error("--join: on, off, both, or a comma-separated sequence of on and off")
    for mode, join in ((m, j) for m in modes for j in joins):
        runner = Runner(
            model_dir,
            max_batch=32,
            prefill_batch=8,
            prefill_chunk=2048,
            fused=mode == "on",
            pad_rows=profile(backend_name()).pad_rows
            if args.pad_rows == "auto"
            else args.pad_rows == "on",
            # the worker's decode attention (before session 22 the probe ran
            # MLX's on CUDA, where the worker runs its own kernel)
            ragged_decode=profile(backend_name()).ragged_decode,
            join_projections=join == "on",
        )
        for calibrate_s in ((), (0.0,))[not args.calibrated_only] + (args.calibrate_s,):
            probe = _probe(
                runner,
                calibrate_s,
                args.streams,
                args.prompt,
                args.profile,
                args.sync,
                args.long_tokens,
                args.after,
                args.repeat,
                args.trace,
                args.chunk,
                args.count_ops,
                None if args.admission_cost == "default" else args.admission_cost == "on",
            )
            run = {"fused": runner.fused, "joined": runner.generator.joined, **probe}
            result["runs"].append(run)
            print(
                f"fused {runner.fused}, joined {run['joined']}, calibrate {calibrate_s:g}s: "
                f"warm-up {run['warmup_s']}s; "
                f"steady step {run['steady_step_ms']} ms; {run['paced_steps']} paced steps, "
                f"max {run['max_step_ms']} ms, median {run['median_step_ms']} ms; long TTFT "
                f"{run['long_ttft_ms']} ms vs idle {run['idle_ttft_ms']} ms; first steps "
                f"{run['steps'][:6]}; last steps {run['steps'][-3:]}; after {run['after']}",
                flush=True,
            )
            for i, again in enumerate(run["repeats"], 2):
                print(
                    f"  arrival {i}: TTFT {again['long_ttft_ms']} ms; first steps "
                    f"{again['steps'][:3]}; last {again['steps'][-3:]}; after {again['after']}",
                    flush=True,
                )
            for name, ops in run["ops"].items():
                print(f"  {name}: {sum(ops.values())} primitives {ops}", flush=True)
            for name, text in run["profiles"].items():
                print(f"-- {name} step\n{text}", flush=True)
        runner.close()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
