"""GPU diagnosis 2 (#12): new-shape cost per (graphs, cuDNN SDPA); burst rule; mixed pressure.

Run by job2.sh on the H200 (from the project root, MLX on PYTHONPATH)."""

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
res = {
    "graphs": os.environ.get("MLX_USE_CUDA_GRAPHS"),
    "sdpa": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"),
}


def P(*a):
    print(*a, flush=True)


runner = Runner(Path(model_dir), max_batch=64, prefill_batch=8, prefill_chunk=2048)
V = runner.info.vocab_size
G = SamplingParams(temperature=0.0)
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
    gen.insert([p], max_tokens=[1])
    while not gen.next()[1]:
        pass
    return round((time.perf_counter() - t) * 1e3, 1)


res["A"] = [
    (L, one(L, L))
    for L in [
        256,
        300,
        301,
        302,
        303,
        300,
        301,
        302,
        303,
        1000,
        1001,
        1002,
        1000,
        1001,
        1002,
        2000,
        2001,
        2000,
        2001,
    ]
]
P("A", res["A"])


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
    }


def wave_engine(core, prompts, nt, tag):
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add(Add(f"{tag}{i}", p, nt, G))
    first = {}
    n = 0
    while core.has_work():
        out = core.step()
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
    }


def prompts_for(C, seed):
    r = random.Random(seed)
    return [[r.randrange(V) for _ in range(r.randrange(128, 513))] for _ in range(C)]


cfg = WorkerConfig(
    socket="",
    model=model_dir,
    max_batch=64,
    prefill_batch=8,
    prefill_chunk=2048,
    prefix_cache_bytes=0,
)
core = core_for(cfg, runner)
t = time.perf_counter()
core.warmup(calibrate_s=cfg.pacing_calibration_s)
res["warmup_s"] = time.perf_counter() - t
res["coef"] = list(core.scheduler.cost.predict_coef())
for C in (16, 64):
    for rep in range(2):
        ps = prompts_for(C, 100 * C + rep)
        wave_ceiling(ps, 2)
        wave_engine(core, ps, 2, f"w{C}{rep}")
        row = {
            "C": C,
            "rep": rep,
            "ceiling": wave_ceiling(ps, 128),
            "engine": wave_engine(core, ps, 128, f"m{C}{rep}"),
        }
        res.setdefault("B", []).append(row)
        P("B", json.dumps(row))


# D: mixed pressure in-process: 16 streams, then a long prompt of a new length
# (cold), then again (warm)
def mixed(L, tag):
    for i in range(16):
        core.add(Add(f"{tag}s{i}", [(5 * i + j) % V for j in range(32)], 400, G))
    while core.runner.decoding < 16:
        core.step()
    gaps = []
    for _ in range(30):
        t = time.perf_counter()
        core.step()
        gaps.append(time.perf_counter() - t)
    core.add(Add(f"{tag}long", [(13 * j + L) % V for j in range(L)], 2, G))
    t0 = time.perf_counter()
    ttft = None
    pg = []
    while ttft is None:
        t = time.perf_counter()
        out = core.step()
        now = time.perf_counter()
        pg.append(now - t)
        if out and any(o.request_id == f"{tag}long" and o.token_ids for o in out.outputs):
            ttft = now - t0
    core.abort([f"{tag}s{i}" for i in range(16)])
    while core.has_work():
        core.step()
    core.add(Add(f"{tag}idle", [(13 * j + L + 1) % V for j in range(L)], 2, G))
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
    idle = time.perf_counter() - t0

    def q(xs):
        return round(1e3 * sorted(xs)[int(0.99 * (len(xs) - 1))], 1)

    return {
        "L": L,
        "steady_p99_ms": q(gaps),
        "during_max_ms": round(1e3 * max(pg), 1),
        "during_p99_ms": q(pg),
        "ttft_ms": round(1e3 * ttft, 1),
        "idle_ms": round(1e3 * idle, 1),
        "steps": len(pg),
    }


for L, tag in [(2000, "a"), (2000, "b"), (1900, "c"), (1900, "d")]:
    r = mixed(L, tag)
    res.setdefault("D", []).append(r)
    P("D", r)
Path(os.environ.get("RESULT", "/tmp/diag2.json")).write_text(json.dumps(res, indent=1))
