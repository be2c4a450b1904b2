"""The in-process targets: the ceiling and mlxd's own engine, with no server at all.

Owns the engine-only measurements each run compares mlxd against, both driven
the same way, in their own process, on the same waves:

- `ceiling` (driver "batch_generator"): mlx-lm's BatchGenerator. For every
  wave of the scenarios it is given (the concurrency sweep, the idle long
  prefill and sustained decode), it inserts all prompts of the wave at once
  (the exact token ids the servers' chat template produces), calls `next()`
  until every sequence finished, greedy, with the same max_tokens, EOS stop
  tokens and generator sizes as mlxd's worker (completion batch = the
  workload's largest concurrency, prefill batch 8, prefill step 2048).
- `engine` (driver "engine"): mlxd's worker core, `EngineCore` over `Runner`,
  built with the worker's own defaults (pacing on, prefix cache, memory
  budget, its warm-up request) and the same sizes. It adds every request of a
  wave at once and calls `core.step()` until all retired. Against the ceiling
  it isolates the worker's scheduling, pacing, sampling and bookkeeping; mlxd
  against it isolates the serving path (IPC, gateway, HTTP, SSE, and the load
  generator sharing the machine).

Both time each token as the host sees it after `next()` / `step()` returns and
bias EOS away when the workload suppresses it. Each runs in its own process
(`python -m bench.ceiling SPEC.json OUT.json`, which `run_subprocess` starts) so
its weights and MLX buffers are gone before the next target loads its own, and
it gets the same OpenBLAS preload as mlxd's worker. With `--serve` (started by
`WaveProcess`, for `bench run --interleave`) the process loads and warms up,
then runs one wave per command from its parent (`serve`) and writes the same
result when told it is done.

Threading: the child is single-threaded; `WaveProcess` runs on the parent's
asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from bench.client import RequestRecord
from bench.heap import settle_heap
from bench.workload import PAIRED_KINDS, RequestSpec, Workload

# How a child runs its Waves: all in order, or on the parent's command.
Drive = Callable[["Waves"], dict[str, Any]]
# What drives the waves in the child process, per target name.
DRIVERS = {"ceiling": "batch_generator", "ceiling_alt": "batch_generator", "engine": "engine"}


def spec_for(
    workload: Workload, model_dir: Path, max_batch: int, driver: str = "batch_generator"
) -> dict[str, Any]:
    """The JSON job for the child process: waves of (id, prompt ids, max_tokens)."""
    if driver not in DRIVERS.values():
        raise ValueError(f"unknown driver {driver!r}")

    def req(r: RequestSpec) -> dict[str, Any]:
        return {"id": r.id, "prompt": r.prompt_ids, "max_tokens": r.max_tokens}

    scenarios = [
        {
            "name": s.name,
            "kind": s.kind,
            "waves": [[req(r) for r in wave] for wave in s.waves()],
            "extra": s.params,
        }
        for s in workload.scenarios
        if s.kind in PAIRED_KINDS
    ]
    return {
        "driver": driver,
        "model": str(model_dir),
        "max_batch": max_batch,
        "prefill_batch": 8,
        "prefill_chunk": 2048,
        "suppress_eos": workload.suppress_eos,
        "warmup": [[req(r) for r in w] for w in workload.warmup],
        "scenarios": scenarios,
    }


def run_subprocess(
    spec: dict[str, Any],
    work_dir: Path,
    env_extra: dict[str, str],
    timeout_s: float = 3600.0,
    name: str = "ceiling",
) -> dict[str, Any]:
    """Run the spec's driver in a child process; returns its result JSON.

    `name` (the target) names its files in work_dir, so the ceiling and the
    engine can share one output directory.
    """
    spec_path = work_dir / f"{name}-spec.json"
    out_path = work_dir / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    log = work_dir / f"{name}.log"
    with log.open("wb") as f:
        r = subprocess.run(
            [sys.executable, "-m", "bench.ceiling", str(spec_path), str(out_path)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
            cwd=Path(__file__).resolve().parent.parent,
        )
    if r.returncode != 0:
        raise RuntimeError(
            f"the {name} process failed ({r.returncode}); see {log}:\n"
            + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        )
    result: dict[str, Any] = json.loads(out_path.read_text())
    spec_path.unlink(missing_ok=True)
    out_path.unlink(missing_ok=True)  # results.json keeps all of it
    return result


class WaveProcess:
    """An in-process target's child that runs waves on command (`serve`), for
    `bench run --interleave`: started once, kept loaded and warm, asked for one
    wave at a time while the other targets wait."""

    def __init__(
        self, name: str, proc: asyncio.subprocess.Process, out_path: Path, log: Path
    ) -> None:
        self.name, self.proc, self.out_path, self.log = name, proc, out_path, log

    @classmethod
    async def start(
        cls,
        spec: dict[str, Any],
        work_dir: Path,
        env_extra: dict[str, str],
        name: str,
        timeout_s: float = 1800.0,
    ) -> WaveProcess:
        """Spawn it and wait until it has loaded, prewarmed and warmed up."""
        spec_path = work_dir / f"{name}-spec.json"
        out_path = work_dir / f"{name}-out.json"
        spec_path.write_text(json.dumps(spec))
        log = work_dir / f"{name}.log"
        with log.open("wb") as f:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.ceiling",
                str(spec_path),
                str(out_path),
                "--serve",
                env=dict(os.environ, PYTHONUNBUFFERED="1", **env_extra),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=f,
                cwd=Path(__file__).resolve().parent.parent,
            )
        child = cls(name, proc, out_path, log)
        try:
            await child._reply(timeout_s)
        except BaseException:
            await child.kill()
            raise
        return child

    async def wave(self, scenario: str, index: int, timeout_s: float = 3600.0) -> float:
        """Run wave `index` of `scenario` there; its wall time."""
        await self._send({"scenario": scenario, "wave": index})
        return float((await self._reply(timeout_s))["wall_s"])

    async def finish(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """End it; its result JSON, as `run_subprocess` returns it."""
        await self._send({"done": True})
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        if code != 0:
            raise RuntimeError(self._failure(f"exited with {code}"))
        result: dict[str, Any] = json.loads(self.out_path.read_text())
        self.out_path.unlink(missing_ok=True)
        (self.out_path.parent / f"{self.name}-spec.json").unlink(missing_ok=True)
        return result

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()

    async def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError(self._failure("ended without replying"))
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _failure(self, what: str) -> str:
        tail = self.log.read_text(errors="replace").splitlines()[-30:]
        return f"the {self.name} process {what}; see {self.log}:\n" + "\n".join(tail)


# -- inside the child process ------------------------------------------------------


def _run_wave(gen: Any, wave: list[dict[str, Any]], processors: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    uids = gen.insert(
        [r["prompt"] for r in wave],
        max_tokens=[r["max_tokens"] for r in wave],
        logits_processors=[processors() for _ in wave] if processors else None,
    )
    recs = {
        uid: RequestRecord(r["id"], sent=t0, token_ids=[])
        for uid, r in zip(uids, wave, strict=True)
    }
    live = set(uids)
    # Bounded: every sequence finishes within its max_tokens plus its prefill steps.
    limit = sum(r["max_tokens"] + len(r["prompt"]) + 2 for r in wave) + 16
    for _ in range(limit):
        if not live:
            break
        _, responses = gen.next()
        now = time.monotonic()
        for resp in responses:
            rec = recs.get(resp.uid)
            if rec is None or resp.uid not in live:
                continue
            if rec.first_token is None:
                rec.first_token = now
            rec.events.append((now, 1))
            assert rec.token_ids is not None
            rec.token_ids.append(int(resp.token))
            rec.tokens += 1
            if resp.finish_reason is not None:
                rec.finish_reason = resp.finish_reason
                rec.done = now
                rec.ok = True
                live.discard(resp.uid)
    if live:
        gen.remove(list(live))
        for uid in live:
            recs[uid].error = "did not finish within the step bound"
            recs[uid].done = time.monotonic()
    end = max((r.done or t0) for r in recs.values())
    return {"t0": t0, "wall_s": end - t0, "requests": [r.to_json(t0) for r in recs.values()]}


def _run_wave_engine(core: Any, wave: list[dict[str, Any]], sampling: Any) -> dict[str, Any]:
    """One wave through mlxd's EngineCore, timed like `_run_wave`."""
    from protocol.messages import Add
    from worker.proc import IDLE_RELEASE_S

    # As the worker's loop does: MLX's cached buffers go back once the engine
    # has been idle that long (other targets' waves, in an interleaved run).
    core.release_idle_buffers(IDLE_RELEASE_S)
    t0 = time.monotonic()
    for r in wave:
        core.add(Add(r["id"], r["prompt"], r["max_tokens"], sampling))
    recs = {
        r["id"]: RequestRecord(r["id"], sent=t0, token_ids=[], prompt_tokens=len(r["prompt"]))
        for r in wave
    }
    live = set(recs)
    # Bounded as in _run_wave; paced chunks are never below 16 tokens, so the
    # prompt terms still cover every prefill step.
    limit = sum(r["max_tokens"] + len(r["prompt"]) + 2 for r in wave) + 16
    for _ in range(limit):
        if not live or not core.has_work():
            break
        out = core.step()
        now = time.monotonic()
        if out is None:
            continue  # a prefill-only step: no token yet
        for o in out.outputs:
            rec = recs.get(o.request_id)
            if rec is None or o.request_id not in live:
                continue
            if o.token_ids:
                if rec.first_token is None:
                    rec.first_token = now
                    rec.cached_tokens = o.cached_tokens
                rec.events.append((now, len(o.token_ids)))
                assert rec.token_ids is not None
                rec.token_ids.extend(int(t) for t in o.token_ids)
                rec.tokens += len(o.token_ids)
            if o.finish_reason is not None:
                rec.finish_reason = o.finish_reason
                rec.done = now
                rec.ok = o.finish_reason in ("stop", "length")
                if not rec.ok:
                    rec.error = o.error or f"finished with {o.finish_reason!r}"
                live.discard(o.request_id)
    if live:
        core.abort(list(live))
        core.step()  # retire them, as the worker does after an abort
        for rid in live:
            recs[rid].error = "did not finish within the step bound"
            recs[rid].done = time.monotonic()
    end = max((r.done or t0) for r in recs.values())
    return {"t0": t0, "wall_s": end - t0, "requests": [r.to_json(t0) for r in recs.values()]}


class Waves:
    """One in-process target's scenarios, run wave by wave (by `sequential`, or
    on the parent's command with `serve`), collected in the result shape
    bench/analysis.py reads."""

    def __init__(
        self,
        spec: dict[str, Any],
        label: str,
        run_wave: Callable[[list[dict[str, Any]]], dict[str, Any]],
        after_prewarm: Callable[[], object] | None = None,
    ) -> None:
        self.spec, self.label, self.run_wave = spec, label, run_wave
        self.after_prewarm = after_prewarm
        self.by_name = {s["name"]: s for s in spec["scenarios"]}
        self.done: dict[str, list[dict[str, Any]]] = {}
        self.prewarm_s = 0.0
        self.weights = 0

    def prepare(self) -> None:
        import mlx.core as mx

        if self.spec.get("prewarm", True):
            self.prewarm_s = _prewarm(self.spec, self.run_wave)
            if self.after_prewarm is not None:
                self.after_prewarm()
        for wave in self.spec["warmup"]:
            self.run_wave(wave)
        self.weights = int(mx.get_active_memory())
        mx.reset_peak_memory()
        settle_heap()

    def run(self, scenario: str, index: int) -> float:
        """Wave `index` of `scenario`; returns its wall time."""
        settle_heap()
        wave = self.run_wave(self.by_name[scenario]["waves"][index])
        self.done.setdefault(scenario, []).append(wave)
        return float(wave["wall_s"])

    def result(self) -> dict[str, Any]:
        import mlx.core as mx

        scenarios: dict[str, Any] = {}
        for s in self.spec["scenarios"]:
            waves = self.done.get(s["name"])
            if not waves:
                continue
            t0 = waves[0]["t0"]
            scenarios[s["name"]] = {
                "kind": s["kind"],
                "t0": t0,
                "wall_s": max(w["t0"] + w["wall_s"] for w in waves) - t0,
                "waves": waves,
                "extra": s.get("extra") or {},
            }
        return {
            "weights_bytes": self.weights,
            "peak_bytes": int(mx.get_peak_memory()),
            "prewarm_s": self.prewarm_s,
            "scenarios": scenarios,
        }


def sequential(waves: Waves) -> dict[str, Any]:
    """Every scenario's waves in order, alone on the machine (plain `bench run`)."""
    waves.prepare()
    for s in waves.spec["scenarios"]:
        wall = sum(waves.run(s["name"], i) for i in range(len(s["waves"])))
        print(f"{waves.label} {s['name']}: {wall:.2f}s", flush=True)
    return waves.result()


def serve(commands: TextIO, replies: TextIO) -> Callable[[Waves], dict[str, Any]]:
    """Waves on the parent's command, one JSON line each way (`bench run --interleave`).

    After the warm-up it replies {"ready": true}; then each {"scenario", "wave"}
    runs that wave and replies {"wall_s"}; {"done": true} (or end of input) ends it.
    """

    def drive(waves: Waves) -> dict[str, Any]:
        waves.prepare()
        _reply(replies, {"ready": True})
        for line in commands:
            msg = json.loads(line)
            if msg.get("done"):
                break
            _reply(replies, {"wall_s": waves.run(msg["scenario"], int(msg["wave"]))})
        return waves.result()

    return drive


def _reply(replies: TextIO, msg: dict[str, Any]) -> None:
    replies.write(json.dumps(msg) + "\n")
    replies.flush()


def _prewarm(spec: dict[str, Any], run_wave: Callable[[list[dict[str, Any]]], Any]) -> float:
    """Every measured wave once, untimed, with 2 new tokens: the prompt shapes it
    will meet are compiled before anything is measured.

    MLX compiles kernels on first use of a shape (on CUDA 60-75 ms each, and a
    cold process spends minutes on them) and caches them on disk for later
    processes (/tmp/mlx/<version>/ptx on CUDA). Without this, whichever target
    ran first paid for the shapes and a later one found them compiled: the
    engine looked noisy against mlxd, which ran after it.
    """
    start = time.monotonic()
    for s in spec["scenarios"]:
        for wave in s["waves"]:
            run_wave([{**r, "id": "prewarm/" + r["id"], "max_tokens": 2} for r in wave])
    return time.monotonic() - start


def _main_batch_generator(spec: dict[str, Any], drive: Drive) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.utils import load

    if spec.get("memory_limit_bytes"):
        mx.set_memory_limit(int(spec["memory_limit_bytes"]))  # a GPU shared (bench/run.py)
    start = time.perf_counter()
    model, tokenizer = load(spec["model"])[:2]
    mx.eval(model.parameters())
    load_s = time.perf_counter() - start
    eos = sorted(int(t) for t in tokenizer.eos_token_ids)
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in eos],
        completion_batch_size=spec["max_batch"],
        prefill_batch_size=spec["prefill_batch"],
        prefill_step_size=spec["prefill_chunk"],
    )
    bias = {int(t): -100.0 for t in spec["suppress_eos"]}
    processors = (lambda: make_logits_processors(logit_bias=bias)) if bias else None
    try:
        measured = drive(Waves(spec, "ceiling", lambda w: _run_wave(gen, w, processors)))
    finally:
        gen.close()
    return {"load_s": load_s, **measured}


def _main_engine(spec: dict[str, Any], drive: Drive) -> dict[str, Any]:
    from protocol.messages import SamplingParams
    from protocol.worker_config import DEFAULTS, WorkerConfig
    from worker.core import core_for, runner_for

    # The worker's own defaults (what the gateway passes when nothing is
    # configured, as in the mlxd the benchmark starts), with the run's sizes;
    # MLXD_FUSED_STEP, MLXD_DECODE_ATTENTION, MLXD_DECODE_ROWS and MLXD_IDLE_READ
    # in the benchmark's environment reach this target as --mlxd-env reaches mlxd.
    cfg = WorkerConfig(
        socket="",
        model=spec["model"],
        max_batch=spec["max_batch"],
        prefill_batch=spec["prefill_batch"],
        prefill_chunk=spec["prefill_chunk"],
        fused_step=os.environ.get("MLXD_FUSED_STEP", DEFAULTS.fused_step),
        decode_attention=os.environ.get("MLXD_DECODE_ATTENTION", DEFAULTS.decode_attention),
        decode_rows=os.environ.get("MLXD_DECODE_ROWS", DEFAULTS.decode_rows),
        idle_read=os.environ.get("MLXD_IDLE_READ", str(DEFAULTS.idle_read)).lower()
        in ("1", "on", "true"),
        # A GPU shared with the run's other targets (bench/run.py): its share as
        # the budget, MLX's limit too on CUDA (core_for); 0: the worker's default.
        memory_budget_bytes=int(spec.get("memory_limit_bytes") or 0),
    )
    cfg.validate()
    runner = runner_for(cfg, Path(spec["model"]))  # as the worker process builds it
    core = core_for(cfg, runner)
    # the worker's own warm-up (and pacing calibration), before it reports ready
    warmup_s = core.warmup(calibrate_s=cfg.pacing_calibration_s)
    sampling = SamplingParams(
        temperature=0.0, logit_bias={str(int(t)): -100.0 for t in spec["suppress_eos"]}
    )
    try:
        # The prewarm's prompts must not be found in the prefix cache later.
        measured = drive(
            Waves(
                spec,
                "engine",
                lambda w: _run_wave_engine(core, w, sampling),
                after_prewarm=core.prefix_cache.clear,
            )
        )
        stats = core.stats()
    finally:
        runner.close()
    return {
        "load_s": runner.info.load_time_s,
        "warmup_s": warmup_s,
        "engine": {
            "max_batch": cfg.max_batch,
            "prefill_batch": cfg.prefill_batch,
            "prefill_chunk": cfg.prefill_chunk,
            "pacing": cfg.pacing,
            "pacing_factor": cfg.pacing_factor,
            "pacing_slack": cfg.pacing_slack,
            "fused_step": runner.fused,
            "decode_attention": "ragged" if runner.ragged_decode else "mlx",
            "idle_read": runner.generator.idle_read,
            "decode_rows": runner.generator.decode_rows,
            "chunk_buckets": list(core.scheduler.buckets),
            "memory_budget_bytes": core.governor.config.budget_bytes,
            "kv_budget_bytes": cfg.kv_budget_bytes,
            "prefix_cache_bytes": cfg.prefix_cache_bytes,
        },
        # Counters over the measured waves and the bench's warm-up (the core's own
        # warm-up resets them): steps, tokens, finish reasons, prefix-cache hits.
        "stats": {k: stats[k] for k in ("steps", "generated_tokens", "finish_reasons")}
        | {"prefix_cache": stats["prefix_cache"]},
        **measured,
    }


def main(argv: list[str]) -> int:
    """`python -m bench.ceiling SPEC.json OUT.json [--serve]`."""
    spec = json.loads(Path(argv[0]).read_text())
    drive: Drive = sequential
    if "--serve" in argv[2:]:
        # The parent's commands on stdin, replies on the original stdout; every
        # print (and MLX's own output) goes to stderr, the target's log.
        replies = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        drive = serve(sys.stdin, replies)
    driver = spec.get("driver", "batch_generator")
    if driver == "engine":
        from protocol.worker_config import WorkerConfig
        from worker.backend import apply_env

        # As worker/proc.py does, before MLX's first import: the worker's CUDA
        # graph mode. The ceiling keeps MLX's default (or the caller's variable).
        apply_env(WorkerConfig(socket="", model="").cuda_graphs)
    from worker.modelfiles.default_model import blas_in_use
    from worker.runner import backend_name

    if driver == "engine":
        measured = _main_engine(spec, drive)
    elif driver == "batch_generator":
        measured = _main_batch_generator(spec, drive)
    else:
        raise SystemExit(f"bench.ceiling: unknown driver {driver!r}")
    out = {
        "driver": driver,
        "backend": backend_name(),
        "blas": blas_in_use(),
        "cuda_graphs_env": os.environ.get("MLX_USE_CUDA_GRAPHS", "unset (MLX default: on)"),
        **measured,
    }
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
