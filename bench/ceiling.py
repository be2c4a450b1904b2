"""The ceiling: mlx-lm's BatchGenerator driven in-process, with no server at all.

Owns the engine-only measurement each run compares mlxd against. For every
wave of the scenarios it is given (the concurrency sweep, the idle long
prefill and sustained decode), it inserts all prompts of the wave at once
(the exact token ids the servers' chat template produces), calls `next()` until
every sequence finished, greedy, with the same max_tokens, EOS stop tokens and
generator sizes as mlxd's worker (completion batch = the workload's largest
concurrency, prefill batch 8, prefill step 2048), and times each token as the
host sees it after `next()` returns.

It runs in its own process (`python -m bench.ceiling SPEC.json OUT.json`, which
`run_subprocess` starts) so its weights and MLX buffers are gone before the
servers load theirs, and it gets the same OpenBLAS preload as mlxd's worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.client import RequestRecord
from bench.workload import RequestSpec, Workload

CEILING_KINDS = ("sweep", "long_prefill", "sustained")


def spec_for(workload: Workload, model_dir: Path, max_batch: int) -> dict[str, Any]:
    """The JSON job for the ceiling process: waves of (id, prompt ids, max_tokens)."""

    def req(r: RequestSpec) -> dict[str, Any]:
        return {"id": r.id, "prompt": r.prompt_ids, "max_tokens": r.max_tokens}

    scenarios = []
    for s in workload.scenarios:
        if s.kind not in CEILING_KINDS:
            continue
        if s.kind == "long_prefill":
            # One at a time, as the servers get them: TTFT of a lone long prefill.
            waves = [[req(r)] for r in s.groups["requests"]]
        else:
            waves = [[req(r) for r in g] for g in s.groups.values()]
        scenarios.append({"name": s.name, "kind": s.kind, "waves": waves, "extra": s.params})
    return {
        "model": str(model_dir),
        "max_batch": max_batch,
        "prefill_batch": 8,
        "prefill_chunk": 2048,
        "suppress_eos": workload.suppress_eos,
        "warmup": [[req(r) for r in w] for w in workload.warmup],
        "scenarios": scenarios,
    }


def run_subprocess(
    spec: dict[str, Any], work_dir: Path, env_extra: dict[str, str], timeout_s: float = 3600.0
) -> dict[str, Any]:
    """Run the ceiling in a child process; returns its result JSON."""
    spec_path = work_dir / "ceiling-spec.json"
    out_path = work_dir / "ceiling-out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    log = work_dir / "ceiling.log"
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
            f"the ceiling process failed ({r.returncode}); see {log}:\n"
            + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        )
    result: dict[str, Any] = json.loads(out_path.read_text())
    spec_path.unlink(missing_ok=True)
    out_path.unlink(missing_ok=True)  # results.json keeps all of it
    return result


# -- inside the ceiling process --------------------------------------------------


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


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.utils import load

    from worker.default_model import blas_in_use
    from worker.runner import backend_name

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
    for wave in spec["warmup"]:
        _run_wave(gen, wave, processors)
    weights = int(mx.get_active_memory())
    mx.reset_peak_memory()
    scenarios: dict[str, Any] = {}
    for s in spec["scenarios"]:
        t = time.monotonic()
        waves = [_run_wave(gen, w, processors) for w in s["waves"]]
        scenarios[s["name"]] = {
            "kind": s["kind"],
            "t0": t,
            "wall_s": time.monotonic() - t,
            "waves": waves,
            "extra": s.get("extra") or {},
        }
        print(f"ceiling {s['name']}: {sum(w['wall_s'] for w in waves):.2f}s", flush=True)
    gen.close()
    out = {
        "load_s": load_s,
        "backend": backend_name(),
        "blas": blas_in_use(),
        "weights_bytes": weights,
        "peak_bytes": int(mx.get_peak_memory()),
        "scenarios": scenarios,
    }
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
