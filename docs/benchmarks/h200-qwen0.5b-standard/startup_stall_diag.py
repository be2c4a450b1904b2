"""Scratch diagnostic (issue #12): start-up stall and the engine's idle prefill on CUDA."""
import faulthandler, sys, time, threading
faulthandler.dump_traceback_later(40, repeat=False, file=sys.stdout)  # where a stall sits
from pathlib import Path
from worker.backend import apply_env
apply_env("auto")
t0 = time.perf_counter()
from worker.runner import Runner
import mlx.core as mx
print("import", round(time.perf_counter() - t0, 2), flush=True)
print("threads", [t.name for t in threading.enumerate()], flush=True)
p = Path(sys.argv[1])
r = Runner(p, max_batch=64)
print("runner", round(time.perf_counter() - t0, 2), flush=True)
faulthandler.cancel_dump_traceback_later()
from protocol.worker_config import WorkerConfig
from protocol.messages import Add, SamplingParams
from worker.core import core_for
G = SamplingParams(temperature=0.0)
core = core_for(WorkerConfig(socket="", model=str(p), max_batch=64), r)
print("warmup", core.warmup(calibrate_s=2.0), flush=True)
s = core.scheduler
print("coef", s.cost.predict_coef(), "unit", s.decode_unit_s(), flush=True)
print("idle chunks", {n: s.idle_chunk(n) for n in (127, 300, 511, 1999)}, flush=True)
def run(rid, n, salt):
    core.add(Add(rid, [(13 * j + salt) % 150000 + 10 for j in range(n)], 2, G))
    t = time.perf_counter(); steps = []; first = None
    while core.has_work():
        a = time.perf_counter(); out = core.step(); steps.append((round(1e3 * (time.perf_counter() - a), 1), core.step_log[-1][3]))
        if out and first is None and any(o.token_ids for o in out.outputs): first = time.perf_counter() - t
    print(rid, n, "ttft ms", round(1e3 * first, 1), steps, flush=True)
for i, n in enumerate((1999, 1999, 300, 300, 300, 1999, 417)):
    run(f"r{i}", n, i)
print("coef after", s.cost.predict_coef(), flush=True)
