"""What a sharded model's all-reduces cost per step (issue #16), over mlxd's group environment.

    python -m bench.allreduce_probe [--ranks 2] [--backend ring|nccl] [--hidden 4096]
                                    [--layers 32] [--rows 1,16,64] [--iters 30]
                                    [--dtype bfloat16] [--out probe.json]

A tensor-parallel llama block all-reduces twice per layer (after the
attention's o_proj and after the MLP's down_proj), each over (rows, hidden)
where rows is the tokens in the pass (the decoding rows at a decode step).
This starts `--ranks` processes with the environment mlxd's supervisor gives
a worker group (gateway/workers/launch.py: a loopback ring hostfile, or NCCL's
rendezvous with one GPU per rank and NVLink multicast off), and each rank
times one step's worth: 2 x layers all_sum calls, each on the previous one's
result as a forward pass chains them, evaluated at the end. The per-step
seconds (median over `--iters`) are the collective cost a sharded decode step
pays on top of its 1/N share of the compute; the defaults are the llama8b
shape's. Each value is also checked: the chain of sums and halvings keeps
ones at one only when every rank took part.

Threading: one thread in each process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _child(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from worker.group import init_group

    group = init_group(args.backend)
    dtype = getattr(mx, args.dtype)
    calls = 2 * args.layers
    results: dict[str, Any] = {"rank": int(group.rank()), "size": int(group.size()), "rows": {}}
    for rows in _rows(args.rows):
        x = mx.ones((rows, args.hidden), dtype=dtype)
        times = []
        for i in range(args.iters + 2):  # two untimed: first-use setup
            start = time.perf_counter()
            y = x
            for _ in range(calls):
                y = mx.distributed.all_sum(y, group=group) * (1.0 / group.size())
            mx.eval(y)
            if i >= 2:
                times.append(time.perf_counter() - start)
        results["rows"][str(rows)] = {
            "step_s": statistics.median(times),
            "per_call_s": statistics.median(times) / calls,
            "ok": bool(mx.all(y == 1).item()),
        }
    if group.rank() == 0:
        print(json.dumps(results), flush=True)
    return 0


def _rows(text: str) -> list[int]:
    return [int(r) for r in text.split(",") if r]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the ranks, wait for them, and return rank 0's measurements."""
    from gateway.workers.launch import group_env, launch_env
    from protocol.worker_config import WorkerConfig

    config = WorkerConfig(
        socket="", model="", group_size=args.ranks, group_backend=args.backend, epoch=1
    )
    child = [sys.executable, "-m", "bench.allreduce_probe", "--child"] + [
        f"--{k}={v}" for k, v in _forwarded(args).items()
    ]
    with tempfile.TemporaryDirectory() as private:
        env = launch_env({}, token="", test_faults=False)
        procs = [
            subprocess.Popen(child, env={**env, **rank_env}, stdout=subprocess.PIPE, text=True)
            for rank_env in group_env(config, Path(private))
        ]
        try:
            outs = [p.communicate(timeout=args.timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    result: dict[str, Any] = json.loads(outs[0].strip().splitlines()[-1])
    result["args"] = _forwarded(args)
    return result


def _forwarded(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("backend", "hidden", "layers", "rows", "iters", "dtype")
    return {k: getattr(args, k) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.allreduce_probe")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", choices=("ring", "nccl"), default="ring")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    result = run(args)
    for rows, r in result["rows"].items():
        print(
            f"{args.ranks} ranks ({args.backend}), {rows} rows x {args.hidden}: "
            f"{1e3 * r['step_s']:.3f} ms per step ({2 * args.layers} all-reduces, "
            f"{1e6 * r['per_call_s']:.1f} us each){'' if r['ok'] else ', WRONG SUMS'}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(r["ok"] for r in result["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
