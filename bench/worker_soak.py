"""Worker memory over many requests through the real worker process and its socket.

    python -m bench.worker_soak [--requests 50000] [--concurrency 16] [--every 1000]
                                [--tracemalloc] [--out results.json]

Where bench/engine_soak.py drives EngineCore in-process, this spawns `python -m
worker` on the tiny random model (prefix cache at 4 MiB), connects as the
gateway does (Hello, token), and keeps `--concurrency` requests in flight with
engine_soak's request mix (prompts of 8-400 tokens, logit bias on every row, 15%
aborted after their first output). Every `--every` requests it samples the
worker's RSS from /proc and, with `--tracemalloc`, asks the worker (test-only
`tracemalloc` utility, MLXD_TEST_FAULTS=1) for its Python heap and the lines
that grew most since the first sample.

Threading: a reader thread decodes the worker's frames; the main thread writes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.engine_soak import _request
from protocol.frames import PROTOCOL_VERSION
from protocol.messages import Abort, Hello, Ready, StepOutputs, Utility, UtilityResult
from protocol.transport import FrameReader, write_message
from protocol.worker_config import FAULTS_ENV, TOKEN_ENV, WorkerConfig

TOKEN = "worker-soak"


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _spawn(work: Path, model: Path) -> tuple[subprocess.Popen[bytes], socket.socket, Ready]:
    path = str(work / "w.sock")
    cfg = WorkerConfig(
        socket=path,
        model=str(model),
        model_id="tiny",
        epoch=1,
        prefix_cache_bytes=4 << 20,
        prefill_chunk=128,
    )
    env = dict(os.environ, **{TOKEN_ENV: TOKEN, FAULTS_ENV: "1"})
    log = (work / "worker.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", *cfg.to_argv()],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((work / "worker.log").read_text()) from None
            time.sleep(0.1)
    write_message(s, Hello(PROTOCOL_VERSION, 1, TOKEN))
    ready = FrameReader(s).read_message()
    assert isinstance(ready, Ready), ready
    return proc, s, ready


def soak(args: argparse.Namespace, work: Path, model: Path) -> list[dict[str, Any]]:
    proc, sock, ready = _spawn(work, model)
    events: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        reader = FrameReader(sock)
        with contextlib.suppress(OSError):  # the socket closed under us at the end
            while (msg := reader.read_message()) is not None:
                events.put(msg)
        events.put(None)

    threading.Thread(target=read, daemon=True).start()
    lock = threading.Lock()
    call = 0

    def utility(method: str, **kw: Any) -> Any:
        nonlocal call
        call += 1
        with lock:
            write_message(sock, Utility(call, method, kw))
        return call

    rng = random.Random(args.seed)
    vocab = max(ready.vocab_size, 64)
    inflight: set[str] = set()
    to_abort: set[str] = set()
    added = 0
    start = time.monotonic()
    samples: list[dict[str, Any]] = []
    results: dict[int, Any] = {}
    if args.tracemalloc:
        utility("tracemalloc", frames=args.frames)

    def pump(block: bool) -> None:
        try:
            msg = events.get(timeout=30) if block else events.get_nowait()
        except queue.Empty:
            return
        if msg is None:
            raise RuntimeError("worker closed the connection")
        if isinstance(msg, StepOutputs):
            for o in msg.outputs:
                if o.finish_reason is not None:
                    inflight.discard(o.request_id)
                elif o.request_id in to_abort:
                    to_abort.discard(o.request_id)
                    with lock:
                        write_message(sock, Abort([o.request_id]))
        elif isinstance(msg, UtilityResult):
            results[msg.call_id] = msg

    def sample() -> None:
        row: dict[str, Any] = {
            "requests": added,
            "elapsed_s": round(time.monotonic() - start, 1),
            "worker_rss_mib": _rss_mib(proc.pid),
        }
        if args.tracemalloc:
            cid = utility("tracemalloc", top=args.top)
            while cid not in results:
                pump(True)
            row["tracemalloc"] = results.pop(cid).result
        samples.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(samples))

    sample()
    try:
        while added < args.requests:
            while added < args.requests and len(inflight) < args.concurrency:
                add = _request(added, rng, vocab)
                with lock:
                    write_message(sock, add)
                inflight.add(add.request_id)
                if rng.random() < 0.15:
                    to_abort.add(add.request_id)
                added += 1
                if added % args.every == 0:
                    sample()
            pump(True)
            while not events.empty():
                pump(False)
        while inflight:
            pump(True)
        time.sleep(1)
        sample()
    finally:
        sock.close()
        proc.wait(30)
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker_soak", description=__doc__)
    p.add_argument("--requests", type=int, default=50_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from worker.modelfiles.random_model import make_random_model

    with tempfile.TemporaryDirectory(prefix="mlxd-worker-soak-") as tmp:
        work = Path(tmp)
        model = make_random_model(work / "tiny", seed=0)
        samples = soak(args, work, model)
    base = samples[max(1, len(samples) // 5)]
    growth = samples[-1]["worker_rss_mib"] - base["worker_rss_mib"]
    result = {
        "settings": vars(args),
        "samples": samples,
        "rss_growth_mib_after_20pct": round(growth, 1),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"worker RSS {base['worker_rss_mib']} MiB at {base['requests']} -> "
        f"{samples[-1]['worker_rss_mib']} at {samples[-1]['requests']}: {growth:+.1f} MiB",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
