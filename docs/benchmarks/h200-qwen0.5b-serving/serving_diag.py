"""Where mlxd's C=1 inter-token gap goes on the H200 (issue #12, item 7).

One C=1 workload (N requests, P prompt tokens, M new tokens, greedy, EOS
suppressed) through several paths, each timed on its own clock:

- engine: EngineCore in this process, one thread (the benchmark's engine target).
- engine+io: the same, with a writer thread that msgpack-encodes every
  StepOutputs onto a socketpair and a reader thread that drains it (the
  worker's IO threads without its process).
- worker[-variant]: the real worker process (`python -m worker`, the
  gateway's defaults), driven over its Unix socket; tokens timed when their
  frame arrives; the worker's own step log fetched afterwards, so the gap
  splits into "inside core.step" and "between steps".

Usage (from the project root, MLX on PYTHONPATH):
    python serving_diag.py MODEL_DIR OUT.json [variant ...]
"""

import itertools
import json
import os
import queue
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from protocol.frames import PROTOCOL_VERSION
from protocol.messages import Add, Hello, Ready, SamplingParams, StepOutputs, Utility, UtilityResult
from protocol.transport import FrameReader, write_message
from protocol.worker_config import TOKEN_ENV, WorkerConfig

N, P, M = 4, 384, 128
MODEL = sys.argv[1]
OUT = Path(sys.argv[2])
VARIANTS = sys.argv[3:] or ["engine", "engine+io", "worker"]

# The worker with one of its process-level extras removed, by patching the
# module attribute its main() reads before it runs.
PATCHES = {
    "worker": "",
    "worker-nommap": "import worker.runner as r; r.fix_mmap_threshold = lambda: False",
    "worker-notrim": "import worker.proc as p; p.start_malloc_trimmer = lambda *a, **k: None",
    "worker-pyswitch": "import worker.proc as p; p._set_switch_interval = lambda: None",
}
ENVS = {"worker-graphs": {"MLX_USE_CUDA_GRAPHS": "1"}}


def P_(*a: object) -> None:
    print(*a, flush=True)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(min(1000, vocab // 2), min(vocab, 30000)) for _ in range(P)]
        for _ in range(N)
    ]


def summarise(name: str, per_req: list[dict], steps: list[list[float]]) -> dict:
    gaps = [g for r in per_req for g in r["gaps"]]
    out = {
        "variant": name,
        "ttft_ms": statistics.mean(r["ttft"] for r in per_req) * 1e3,
        "gap_mean_ms": statistics.mean(gaps) * 1e3,
        "gap_p50_ms": statistics.median(gaps) * 1e3,
        "tok_s": sum(len(r["gaps"]) + 1 for r in per_req) / sum(r["wall"] for r in per_req),
    }
    # steps: [end time, seconds, decoding rows, prompt tokens]; decode-only steps
    dec = [s for s in steps if s[3] == 0 and s[2] > 0]
    if len(dec) > 2:
        inside = [s[1] for s in dec]
        between = [b[0] - b[1] - a[0] for a, b in itertools.pairwise(dec)]
        between = [x for x in between if x < 0.05]  # not across requests
        out |= {
            "step_mean_ms": statistics.mean(inside) * 1e3,
            "step_p50_ms": statistics.median(inside) * 1e3,
            "between_mean_ms": statistics.mean(between) * 1e3 if between else None,
        }
    P_(json.dumps(out))
    return out


def run_engine(with_io: bool) -> dict:
    from worker.backend import apply_env

    apply_env("auto")
    from worker.core import core_for, runner_for

    cfg = WorkerConfig(socket="", model=MODEL)
    runner = runner_for(cfg, Path(MODEL))
    core = core_for(cfg, runner)
    core.warmup(calibrate_s=cfg.pacing_calibration_s)
    sampling = SamplingParams(
        temperature=0.0, logit_bias={str(t): -100.0 for t in runner.info.eos_token_ids}
    )
    send = None
    if with_io:
        import msgpack

        a, b = socket.socketpair()
        box: queue.Queue = queue.Queue(maxsize=1024)

        def writer() -> None:
            while (m := box.get()) is not None:
                data = msgpack.packb([m.step, [[o.request_id, o.token_ids] for o in m.outputs]])
                a.sendall(len(data).to_bytes(4, "big") + data)

        def reader() -> None:
            while b.recv(65536):
                pass

        threading.Thread(target=writer, daemon=True).start()
        threading.Thread(target=reader, daemon=True).start()
        send = box.put
    per_req = []
    since = time.monotonic()
    for i, prompt in enumerate(prompts(runner.info.vocab_size)):
        t0 = time.monotonic()
        core.add(Add(f"r{i}", prompt, M, sampling))
        times = []
        while core.has_work():
            out = core.step()
            if out is None:
                continue
            if send is not None:
                send(out)
            now = time.monotonic()
            times += [now for o in out.outputs if o.token_ids]
        per_req.append(_req(t0, times))
    name = "engine+io" if with_io else "engine"
    res = summarise(name, per_req, core.step_timeline(since))
    runner.close()
    return res


def _req(t0: float, times: list[float]) -> dict:
    return {
        "ttft": times[0] - t0,
        "gaps": [b - a for a, b in itertools.pairwise(times)],
        "wall": times[-1] - t0,
    }


def run_worker(variant: str) -> dict:
    tmp = Path(tempfile.mkdtemp())
    path = str(tmp / "w.sock")
    cfg = WorkerConfig(socket=path, model=MODEL, model_id="m", epoch=1)
    code = (
        PATCHES.get(variant, "")
        + "\nimport sys\nfrom worker.proc import main\nsys.exit(main(sys.argv[1:]))"
    )
    env = dict(os.environ, **{TOKEN_ENV: "t"}, **ENVS.get(variant, {}))
    log = (OUT.parent / f"{variant}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *cfg.to_argv()], env=env, stdout=log, stderr=log
    )
    s = socket.socket(socket.AF_UNIX)
    deadline = time.monotonic() + 300
    while True:
        try:
            s.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{variant} worker did not start") from None
            time.sleep(0.05)
    write_message(s, Hello(PROTOCOL_VERSION, 1, "t"))
    reader = FrameReader(s)
    ready = reader.read_message()
    assert isinstance(ready, Ready), ready
    sampling = SamplingParams(
        temperature=0.0, logit_bias={str(t): -100.0 for t in ready.eos_token_ids}
    )
    per_req = []
    since = time.monotonic()
    for i, prompt in enumerate(prompts(ready.vocab_size)):
        t0 = time.monotonic()
        write_message(s, Add(f"r{i}", prompt, M, sampling))
        times: list[float] = []
        done = False
        while not done:
            msg = reader.read_message()
            now = time.monotonic()
            if not isinstance(msg, StepOutputs):
                continue
            for o in msg.outputs:
                times += [now] * len(o.token_ids)
                done |= o.finish_reason is not None
        per_req.append(_req(t0, times))
    write_message(s, Utility(1, "step_timeline", {"since": since}))
    while not isinstance(msg := reader.read_message(), UtilityResult):
        pass
    res = summarise(variant, per_req, msg.result["steps"])
    s.close()
    proc.wait(timeout=60)
    return res


results = []
for v in VARIANTS:
    try:
        if v.startswith("engine"):
            results.append(run_engine(v == "engine+io"))
        else:
            results.append(run_worker(v))
    except Exception as e:  # one variant's failure must not lose the others
        P_(f"{v} failed: {e!r}")
        results.append({"variant": v, "error": repr(e)})
    OUT.write_text(json.dumps(results, indent=1))
