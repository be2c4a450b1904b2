"""Launching a worker process group: its environment, each rank's MLX setup, the processes.

Every worker is a fresh interpreter (`python -m worker`, spawn semantics) whose
command line is its WorkerConfig (protocol/worker_config.py). The handshake token
travels in the environment, never on the command line (visible in `ps`). A sharded
group (docs/distributed.md) gets one process per rank, each with MLX's distributed
environment: a ring hostfile on loopback ports, or NCCL's rendezvous with one GPU
per rank. The supervisor (gateway/workers/supervisor.py) decides when to launch.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from pathlib import Path

from protocol.worker_config import FAULTS_ENV, TOKEN_ENV, WorkerConfig, openblas_preload_path

log = logging.getLogger("mlxd.gateway.supervisor")


def launch_env(extra_env: dict[str, str], token: str, *, test_faults: bool) -> dict[str, str]:
    """The environment every rank of a worker starts with."""
    env = dict(os.environ, **extra_env)
    env[TOKEN_ENV] = token
    if test_faults:
        env[FAULTS_ENV] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Debian's OpenBLAS makes MLX's CPU backend 20-30x faster (DESIGN.md §6).
    preload = openblas_preload_path()
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = preload
    return env


async def spawn_group(
    config: WorkerConfig, env: dict[str, str], private_dir: Path
) -> list[asyncio.subprocess.Process]:
    """Start every rank (rank 0 first); `private_dir` (0700) holds a ring's hostfile."""
    size = config.group_size
    procs = []
    for rank, rank_env in enumerate(group_env(config, private_dir)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker", *config.to_argv(), env={**env, **rank_env}
        )
        procs.append(proc)
        log.info(
            "worker started: pid %d, epoch %d, rank %d of %d", proc.pid, config.epoch, rank, size
        )
    return procs


def group_env(config: WorkerConfig, private_dir: Path) -> list[dict[str, str]]:
    """Each rank's MLX distributed environment (one empty dict for a single worker)."""
    size, backend = config.group_size, config.group_backend
    if size == 1:
        return [{}]
    ports = _free_ports(size)
    common = {"MLX_WORLD_SIZE": str(size)}
    if backend == "ring":
        hostfile = private_dir / f"hosts-{config.epoch}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        common["MLX_HOSTFILE"] = str(hostfile)
    else:  # nccl: rank 0 hosts the rendezvous; one GPU per rank
        common.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(ports[0]), NCCL_NVLS_ENABLE="0")
    return [
        {
            **common,
            "MLX_RANK": str(r),
            **({"CUDA_VISIBLE_DEVICES": str(r)} if backend == "nccl" else {}),
        }
        for r in range(size)
    ]


async def first_exit(procs: list[asyncio.subprocess.Process]) -> int:
    """The exit code of whichever rank exits first."""
    waits = [asyncio.ensure_future(p.wait()) for p in procs]
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return next(iter(done)).result()
    finally:
        for w in waits:
            w.cancel()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
