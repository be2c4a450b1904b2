"""Worker memory over many requests: EngineCore driven in-process, RSS sampled.

    python -m bench.engine_soak [--model DIR] [--requests 50000] [--concurrency 16]
                                [--every 1000] [--tracemalloc] [--out results.json]

Builds the engine the worker builds (`worker.core.core_for` with the default
`WorkerConfig`, prefix cache at 4 MiB so it fills and evicts, as in `make
soak`) on the tiny random model unless `--model` is given, and keeps
`--concurrency` requests in flight until `--requests` have been added: prompts
of 8-400 tokens, a quarter of them sharing a system-prompt prefix (prefix-cache
hits), 1-48 new tokens, greedy, sampled and seeded rows with a logit bias, logprobs,
stop token ids, and 15% aborted after a few steps. No sockets and no gateway:
this measures the worker's own memory at a fraction of `make soak`'s cost.

It sets the allocator up as the worker process does (glibc's mmap threshold
pinned, the malloc-trim thread beside the engine); `--no-trim` leaves both out,
to see the drift they prevent.
Every `--every` requests it samples the process's RSS, MLX's active and cache
memory, the prefix cache's bytes, the number of live Python objects (gc) and,
with `--tracemalloc`, the Python heap. The verdict compares the RSS of the last
sample with the sample at 20% of the run (after warm-up growth): flat means
under 8 MiB of growth.

Threading: one thread, as the worker's engine thread.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from protocol.messages import Add, SamplingParams


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; ru_maxrss elsewhere is only the peak)."""
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _request(i: int, rng: random.Random, vocab: int) -> Add:
    n = rng.randint(8, 400)
    prompt = [rng.randrange(3, vocab) for _ in range(n)]
    if rng.random() < 0.25:  # a shared system prompt: prefix-cache hits
        prompt = [7, 11, 13, 17, 19, 23, 29, 31] * 6 + prompt[:24]
    # As `make soak`: EOS banned by a logit bias on every request (a per-row logits
    # processor), temperature 0, 0.7 or 1, a fifth of them seeded.
    bias = {"0": -100.0, "1": -100.0, "2": -100.0}
    temperature = rng.choice([0.0, 0.7, 1.0])
    seed = rng.randint(0, 1000) if rng.random() < 0.2 else None
    sampling = SamplingParams(temperature=temperature, seed=seed, logit_bias=bias)
    logprobs = rng.random() < 0.2
    return Add(
        f"r{i}",
        prompt,
        rng.randint(1, 48),
        sampling,
        stop_token_ids=[rng.randrange(3, vocab)] if rng.random() < 0.3 else [],
        logprobs=logprobs,
        top_logprobs=rng.choice([0, 3]) if logprobs else 0,
        priority=rng.choice([0, 0, 0, 1]),
    )


def _sample(
    core: Any, added: int, start: float, heap: bool, trim_probe: bool = False
) -> dict[str, Any]:
    from worker.runner import memory_stats

    gc.collect()
    mem = memory_stats()
    row = {
        "requests": added,
        "elapsed_s": round(time.monotonic() - start, 1),
        "rss_mib": round(rss_bytes() / 2**20, 1),
        "mlx_active_mib": round(mem["active_bytes"] / 2**20, 1),
        "mlx_cache_mib": round(mem["cache_bytes"] / 2**20, 1),
        "prefix_cache_kib": round(core.prefix_cache.nbytes / 1024, 1),
        "python_objects": len(gc.get_objects()),
    }
    if heap:
        row["python_heap_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
    if trim_probe:
        # What the C allocator holds but does not use: RSS given back by a trim.
        from worker.runner import trim_malloc

        trim_malloc()
        row["rss_after_trim_mib"] = round(rss_bytes() / 2**20, 1)
    return row


def soak(core: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    vocab = max(core.runner.info.vocab_size, 64)
    added = 0
    aborts: dict[str, int] = {}  # request id -> steps left before its abort
    start = time.monotonic()
    samples = [_sample(core, 0, start, args.tracemalloc)]
    while added < args.requests or core.has_work():
        while added < args.requests and len(core.requests) < args.concurrency:
            add = _request(added, rng, vocab)
            core.add(add)
            if rng.random() < 0.15:
                aborts[add.request_id] = rng.randint(1, 6)
            added += 1
            if added % args.every == 0:
                samples.append(_sample(core, added, start, args.tracemalloc, args.trim_probe))
                print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
                if args.out:  # partial results survive a run cut short by a time limit
                    Path(args.out).with_suffix(".partial.json").write_text(json.dumps(samples))
        core.step()
        for rid in list(aborts):
            aborts[rid] -= 1
            if aborts[rid] <= 0:
                del aborts[rid]
                core.abort([rid])
    samples.append(_sample(core, added, start, args.tracemalloc))
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_soak", description=__doc__)
    p.add_argument("--model", default="", help="model directory (default: tiny random model)")
    p.add_argument("--requests", type=int, default=50_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument(
        "--no-trim",
        action="store_true",
        help="without the worker's allocator settings (mmap threshold, malloc-trim thread)",
    )
    p.add_argument("--trim-probe", action="store_true", help="also sample RSS after malloc_trim")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.tracemalloc:
        tracemalloc.start()
    if not args.no_trim:  # as the worker process does at start (worker/proc.py main)
        from worker.runner import fix_mmap_threshold

        fix_mmap_threshold()
    from protocol.worker_config import WorkerConfig
    from worker.core import core_for
    from worker.runner import Runner

    with tempfile.TemporaryDirectory(prefix="mlxd-engine-soak-") as work:
        model = Path(args.model) if args.model else None
        if model is None:
            from worker.modelfiles.random_model import make_random_model

            model = make_random_model(Path(work) / "tiny", seed=0)
        cfg = WorkerConfig(socket="", model=str(model), prefix_cache_bytes=4 << 20)
        runner = Runner(
            model,
            max_batch=cfg.max_batch,
            prefill_batch=cfg.prefill_batch,
            prefill_chunk=cfg.prefill_chunk,
        )
        core = core_for(cfg, runner)
        core.warmup(calibrate_s=0)
        stop_trim = threading.Event()
        if not args.no_trim:  # as the worker process does (worker/proc.py)
            from worker.proc import start_malloc_trimmer

            start_malloc_trimmer(core, stop_trim)
        try:
            samples = soak(core, args)
        finally:
            stop_trim.set()
    base = samples[max(1, len(samples) // 5)]
    growth = samples[-1]["rss_mib"] - base["rss_mib"]
    result = {
        "model": args.model or "tiny random (seed 0)",
        "settings": vars(args),
        "finish_reasons": core.counters.finish_reasons,
        "samples": samples,
        "rss_growth_mib_after_20pct": round(growth, 1),
        "flat": growth < 8,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(
        f"RSS {base['rss_mib']} MiB at request {base['requests']} -> {samples[-1]['rss_mib']} MiB "
        f"at {samples[-1]['requests']}: {growth:+.1f} MiB",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
