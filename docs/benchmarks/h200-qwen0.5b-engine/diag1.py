"""GPU diagnosis 1 (#12): shape compiles, burst admission, idle TTFT; engine vs ceiling.

Run by job1.sh on the H200 (from the project root, MLX on PYTHONPATH)."""

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from mlx_lm.generate import BatchGenerator

from protocol.messages import Add, SamplingParams
from protocol.worker_config import WorkerConfig
from worker.core import core_for
from worker.runner import Runner

model_dir = sys.argv[1]
res = {"graphs": os.environ.get("MLX_USE_CUDA_GRAPHS", "default")}


def P(*a):
    print(*a, flush=True)


cfg = WorkerConfig(socket="", model=model_dir)
runner = Runner(Path(model_dir), max_batch=64, prefill_batch=8, prefill_chunk=2048)
V = runner.info.vocab_size
G = SamplingParams(temperature=0.0)

# A. raw BatchGenerator: does a new prompt length cost a compile?
gen = BatchGenerator(
    runner.model,
    stop_tokens=[],
    completion_batch_size=64,
    prefill_batch_size=8,
    prefill_step_size=2048,
)


def one(L, seed):
    p = [(seed * 31 + j * 7) % V for j in range(L)]
    t = time.perf_counter()
    (_uid,) = gen.insert([p], max_tokens=[1])
    while True:
        _, rs = gen.next()
        if rs:
            break
    return (time.perf_counter() - t) * 1e3


times = []
for L in [256, 300, 301, 302, 303, 300, 301, 302, 303, 512, 511, 510, 512, 511, 510]:
    times.append((L, round(one(L, L), 1)))
res["A_len_ms"] = times
P("A", times)


def wave_ceiling(prompts, nt):
    t0 = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[nt] * len(prompts))
    first = {}
    live = set(uids)
    n = 0
    while live:
        _, rs = gen.next()
        now = time.perf_counter()
        for r in rs:
            n += 1
            first.setdefault(r.uid, now - t0)
            if r.finish_reason:
                live.discard(r.uid)
    wall = time.perf_counter() - t0
    return {
        "tok_s": round(n / wall, 1),
        "ttft_p50_ms": round(1e3 * statistics.median(first.values()), 1),
        "wall_s": round(wall, 3),
    }


def wave_engine(core, prompts, nt, tag):
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add(Add(f"{tag}{i}", p, nt, G))
    first = {}
    n = 0
    steps = 0
    while core.has_work():
        out = core.step()
        steps += 1
        now = time.perf_counter()
        if out:
            for o in out.outputs:
                if o.token_ids:
                    n += len(o.token_ids)
                    first.setdefault(o.request_id, now - t0)
    wall = time.perf_counter() - t0
    return {
        "tok_s": round(n / wall, 1),
        "ttft_p50_ms": round(1e3 * statistics.median(first.values()), 1),
        "wall_s": round(wall, 3),
        "steps": steps,
    }


rng = random.Random(0)


def prompts_for(C, seed):
    r = random.Random(seed)
    return [[r.randrange(V) for _ in range(r.randrange(128, 513))] for _ in range(C)]


def engine(**kw):
    c = WorkerConfig(
        socket="",
        model=model_dir,
        max_batch=64,
        prefill_batch=8,
        prefill_chunk=2048,
        prefix_cache_bytes=0,
        **kw,
    )
    core = core_for(c, runner)
    core.warmup(calibrate_s=c.pacing_calibration_s)
    return core


variants = {"default": {}, "nopacing": {"pacing": False}}
cores = {k: engine(**v) for k, v in variants.items()}
res["coef"] = {k: list(c.scheduler.cost.predict_coef()) for k, c in cores.items()}
for C, NT in [(1, 64), (16, 128), (64, 128)]:
    for rep in range(2):
        ps = prompts_for(C, 100 * C + rep)
        # prewarm identical shapes for each, as the bench does
        wave_ceiling(ps, 2)
        for k, core in cores.items():
            wave_engine(core, ps, 2, f"w{C}{rep}{k}")
        row = {"C": C, "rep": rep, "ceiling": wave_ceiling(ps, NT)}
        for k, core in cores.items():
            row[k] = wave_engine(core, ps, NT, f"m{C}{rep}{k}")
        res.setdefault("B", []).append(row)
        P("B", json.dumps(row))
# unwarmed shapes (fresh prompts, no prewarm): what serving meets
for C in (1, 16):
    ps = prompts_for(C, 999 + C)
    row = {"C": C, "cold": True, "ceiling": wave_ceiling(ps, 64)}
    ps = prompts_for(C, 1999 + C)
    row["default"] = wave_engine(cores["default"], ps, 64, f"c{C}")
    res.setdefault("B", []).append(row)
    P("B", json.dumps(row))
# C. idle TTFT without the idle buffer release
core = cores["default"]
ps = prompts_for(1, 5)
wave_engine(core, ps, 2, "cw")
a = wave_engine(core, ps, 16, "ca")
runner.release_buffers = lambda: None
b = wave_engine(core, ps, 16, "cb")
res["C"] = {"with_release": a, "without_release": b}
P("C", res["C"])
out = Path(os.environ.get("RESULT", "/tmp/diag.json"))
out.write_text(json.dumps(res, indent=1))
