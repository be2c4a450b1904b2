"""`python -m bench.step_probe SHAPE DRIVER ROWS`: one process's decode steps, rep by rep.

Inserts ROWS prompts at once into mlx-lm's BatchGenerator (`ceiling`) or mlxd's
EngineCore over Runner (`engine`), steps until all are done, and prints each
rep's median and mean step time (prefill and the last steps left out). The
reps run the same work in the same process, so their spread is the machine's
own drift, not the code's: on the H200 (session 7) one process's reps moved
between 6.5 and 10.6 ms per step (docs/benchmarks/README.md). `engine` also
prints the share of each step inside `generator.next()`, and with
`MLXD_STEP_PROBE_PROFILE=1` a cProfile of its last rep. `MLXD_STEP_PROBE_VARLEN=1`
gives the prompts random lengths (32-511 tokens) instead of 64 each, and
`MLXD_STEP_PROBE_REPS=N` runs N reps (the first compiles and is not printed);
`MLXD_STEP_PROBE_FUSED=on|off` sets the engine's fused step (default: the
worker's `auto`, on only for CUDA), to profile the GPU's step on a CPU;
`MLXD_DECODE_ATTENTION=mlx|ragged` the engine's decode attention.
Each rep prints its wall-clock span and the CPU its thread last ran on, to
line it up with the GPU's clocks sampled beside it (`nvidia-smi -lms`).

MLX's CUDA settings are mlxd's (graphs and cuDNN attention off) for both
drivers unless the environment sets them, so the two compare like for like.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MLX_ENV = {
    "MLX_USE_CUDA_GRAPHS": "0",
    "MLX_CUDA_USE_CUDNN_SDPA": "0",
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
}
PROMPT_TOKENS, NEW_TOKENS = 64, 200
SKIP_FIRST, SKIP_LAST = 20, 5  # prefill and the ragged end of a rep


def prompts(rows: int, varlen: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(10, 400) for _ in range(rng.randrange(32, 512) if varlen else PROMPT_TOKENS)]
        for _ in range(rows)
    ]


def summary(times: list[float]) -> tuple[float, float]:
    """(median, mean) step seconds of a rep's steady part."""
    steady = sorted(times[SKIP_FIRST:-SKIP_LAST] or times)
    return steady[len(steady) // 2], sum(steady) / len(steady)


def last_cpu() -> int | None:
    """The CPU this thread last ran on (Linux), to tell a slow rep's placement."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def _reps(label: str, reps: int, run: Callable[[int], list[float]]) -> None:
    for rep in range(reps):
        start = time.time()
        times = run(rep)
        if rep == 0:
            continue  # compiles this process's shapes
        p50, mean = summary(times)
        # Wall-clock start and end, to line a rep up with `nvidia-smi -lms`
        # samples of the GPU's clocks (what moves a rep from 6.5 to 10.6 ms?).
        print(
            f"{label} rep {rep}: step ms p50 {p50 * 1e3:.3f} mean {mean * 1e3:.3f}"
            f" wall {start:.3f}-{time.time():.3f} cpu {last_cpu()}",
            flush=True,
        )


def probe_ceiling(model_dir: Path, rows: list[list[int]], reps: int) -> None:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    model = load(str(model_dir))[0]
    gen = BatchGenerator(
        model,
        stop_tokens=[],
        completion_batch_size=64,
        prefill_batch_size=8,
        prefill_step_size=2048,
    )

    def run(rep: int) -> list[float]:
        gen.insert(rows, max_tokens=[NEW_TOKENS] * len(rows))
        times = []
        while gen._generation_batch or gen._prompt_batch or gen._unprocessed_sequences:
            t = time.perf_counter()
            gen.next()
            times.append(time.perf_counter() - t)
        return times

    _reps(f"ceiling rows={len(rows)}", reps, run)


def probe_engine(model_dir: Path, rows: list[list[int]], reps: int, profile: bool) -> None:
    from protocol.messages import Add, SamplingParams
    from protocol.worker_config import WorkerConfig
    from worker.core import core_for, runner_for

    cfg = WorkerConfig(
        socket="",
        model=str(model_dir),
        max_batch=64,
        prefill_batch=8,
        prefill_chunk=2048,
        fused_step=os.environ.get("MLXD_STEP_PROBE_FUSED", "auto"),
        decode_attention=os.environ.get("MLXD_DECODE_ATTENTION", "auto"),
    )
    runner = runner_for(cfg, model_dir)
    core = core_for(cfg, runner)
    core.warmup(calibrate_s=cfg.pacing_calibration_s)
    inside = [0.0]
    generator: Any = runner.generator
    plain_next = generator.next

    def timed_next() -> Any:
        t = time.perf_counter()
        out = plain_next()
        inside[0] += time.perf_counter() - t
        return out

    generator.next = timed_next
    sampling = SamplingParams(temperature=0.0)

    def run(rep: int) -> list[float]:
        for i, p in enumerate(rows):
            core.add(Add(f"r{rep}-{i}", p, NEW_TOKENS, sampling))
        prof = cProfile.Profile() if profile and rep == reps - 1 else None
        times, inside[0] = [], 0.0
        if prof:
            prof.enable()
        while core.has_work():
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
        if prof:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
            print(out.getvalue())
        print(f"  inside generator.next: {inside[0] / sum(times):.3f} of the steps' time")
        return times

    _reps(f"engine rows={len(rows)}", reps, run)
    runner.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("ceiling", "engine"):
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    for k, v in MLX_ENV.items():
        os.environ.setdefault(k, v)
    from protocol.hidden_imports import hide_unused_frameworks

    hide_unused_frameworks()
    from bench.models import shape_model

    model_dir = Path(shape_model(argv[0]))
    rows = prompts(int(argv[2]), os.environ.get("MLXD_STEP_PROBE_VARLEN") == "1")
    reps = int(os.environ.get("MLXD_STEP_PROBE_REPS", "0"))
    if argv[1] == "ceiling":
        probe_ceiling(model_dir, rows, reps=reps or 3)
    else:
        probe_engine(model_dir, rows, reps or 4, os.environ.get("MLXD_STEP_PROBE_PROFILE") == "1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
