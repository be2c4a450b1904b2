"""Prefix probe: where a warm shared-prefix turn's time goes, in-process.

    python -m bench.prefix_probe [--shape tiny|qwen0.5b|llama8b | --model DIR]
                                 [--history 2000] [--turns 4] [--reply 64]
                                 [--user 32] [--conversations 2] [--out probe.json]
                                 [--chunk-start on|off|both] [--profile] [--sync]
                                 [--idle-read on|off] [--reply-as generated|other]

Owns one measurement the full benchmark also makes (its `shared_prefix`
scenario), without a server: mlxd's EngineCore as the worker builds it
(`core_for`, the prefix cache at its default size, the worker's warm-up), then
conversations one at a time: a `--history`-token system prompt, then turns
that append the previous reply and a `--user`-token message. Per turn it
records the TTFT (add to first token, `time.perf_counter()` around each
`core.step()`), every step until the first token (seconds, prompt tokens), and
the time the engine thread spent in the prefix-cache lookup and in the
runner's insert (lazy MLX work shows up in the step that evaluates it).

`--sync` (session 12) waits for the device around each stage instead, so its
device time lands in its own column: before the add (what the previous turn
left queued), after the lookup (the cache copy) and after the insert (the
merge into a batch); the first step then holds only its own passes. On the
H200 a warm 32-token turn over a 2,064-token history took a median 32 ms on
the 0.5B shape and on the 8B one alike, where its pass should cost a few ms
on either: this says which stage holds the rest. Synchronising changes what
overlaps, so its TTFTs are for reading, not for the speedup.

`--reply-as other` (session 19): each turn's reply comes back as other
tokens, so a warm turn reuses the previous prompt only and prefills the
reply and the new message (about 100 tokens), the prefix cache's entry (the
previous prompt and its reply) cut at the prompt's end. The benchmark's
shared-prefix turns do this: a random-weight model's reply, detokenized and
tokenized again in the next request, is other tokens (session 18's H200 run:
73 new tokens over the previous prompt's 2,016, 24-36 ms a warm step through
mlxd against 15-25 ms for this probe's 32 over 2,064).

Threading: one thread; MLX only in this process.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _timed(
    fn: Callable[..., Any], into: list[float], sync: Callable[[], None] | None = None
) -> Callable[..., Any]:
    """`fn`, its seconds appended to `into`; with `sync`, until the device is done with
    what it queued."""

    def wrapper(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            out = fn(*args, **kw)
            if sync is not None:
                sync()
            return out
        finally:
            into.append(time.perf_counter() - t)

    return wrapper


def _synchronize() -> None:
    import mlx.core as mx

    mx.synchronize()


PROFILE_LINES = 30


def _profile_text(prof: cProfile.Profile) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(PROFILE_LINES)
    stats.sort_stats("cumulative").print_stats(PROFILE_LINES)
    return out.getvalue()


def _turn(
    core: Any,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    profile: bool = False,
    sync: bool = False,
) -> dict[str, Any]:
    from protocol.messages import Add, SamplingParams

    lookups: list[float] = []
    inserts: list[float] = []
    waits: list[float] = []
    lookup, insert = core.prefix_cache.lookup, core.runner.insert
    synchronize = _synchronize if sync else None
    core.prefix_cache.lookup = _timed(lookup, lookups, synchronize)
    core.runner.insert = _timed(insert, inserts, synchronize)
    prof = cProfile.Profile() if profile else None
    try:
        steps: list[tuple[float, int]] = []
        tokens: list[int] = []
        cached = 0
        if synchronize is not None:
            _timed(synchronize, waits)()
        t_add = time.perf_counter()
        if prof is not None:
            prof.enable()
        core.add(Add(rid, prompt, max_tokens, SamplingParams(temperature=0.0)))
        ttft = None
        while rid in core.requests:
            t = time.perf_counter()
            out = core.step()
            if ttft is None:
                steps.append((time.perf_counter() - t, int(core.step_log[-1][3])))
            for o in out.outputs if out else []:
                if o.request_id == rid and o.token_ids:
                    if ttft is None:
                        ttft = time.perf_counter() - t_add
                        cached = o.cached_tokens
                        if prof is not None:
                            prof.disable()
                    tokens.extend(o.token_ids)
    finally:
        if prof is not None:
            prof.disable()  # a turn that failed before its first token
        core.prefix_cache.lookup, core.runner.insert = lookup, insert
    core.idle()  # as the worker does between a client's turns
    return {
        "profile": _profile_text(prof) if prof is not None else "",
        "prompt_tokens": len(prompt),
        "cached_tokens": cached,
        "ttft_ms": round(1e3 * (ttft or 0.0), 3),
        "lookup_ms": round(1e3 * sum(lookups), 3),
        "insert_ms": round(1e3 * sum(inserts), 3),
        "queued_before_ms": round(1e3 * sum(waits), 3) if sync else None,
        "steps_to_first_token": [(round(1e3 * s, 3), p) for s, p in steps],
        "reply": tokens,
    }


def probe(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from protocol.worker_config import WorkerConfig
    from worker.core import core_for, runner_for

    cfg = WorkerConfig(socket="", model=str(model_dir), idle_read=args.idle_read == "on")
    runner = runner_for(cfg, model_dir)
    core = core_for(cfg, runner)
    warmup_s = core.warmup()
    vocab = max(runner.info.vocab_size, 2)
    supported = runner.generator.chunk_start
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.chunk_start]
    conversations = []
    used: list[bool] = []
    for c in range(args.conversations):
        runner.generator.chunk_start = supported and modes[c % len(modes)]
        used.append(runner.generator.chunk_start)
        prompt = [(17 * j + 5 * c + 3) % vocab for j in range(args.history)]
        turns = []
        for k in range(args.turns):
            turn = _turn(core, f"c{c}/t{k}", prompt, args.reply, args.profile, args.sync)
            turns.append(turn)
            user = [(13 * j + 7 * k + 11 * c + 1) % vocab for j in range(args.user)]
            reply = turn.pop("reply")
            if args.reply_as == "other":
                reply = [(t + 1) % vocab for t in reply]
            prompt = prompt + reply + user
        conversations.append(turns)
    runner.close()
    by_mode = {
        ("chunk_start" if on else "last_token_pass"): _medians(
            [t for t, u in zip(conversations, used, strict=True) if u == on]
        )
        for on in sorted(set(used), reverse=True)
    }
    warm = [t for turns in conversations for t in turns[1:]]
    slowest = max(warm, key=lambda t: t["ttft_ms"]) if warm else None
    slowest_profile = slowest["profile"] if slowest else ""
    for turns in conversations:
        for t in turns:
            del t["profile"]
    return {
        # cProfile text (--profile; else ""): the slowest warm turn, add to first token
        "profile_slowest_warm": slowest_profile,
        "profile_slowest_warm_ttft_ms": slowest["ttft_ms"] if slowest else None,
        "model": str(model_dir),
        "warmup_s": round(warmup_s, 3),
        "idle_read": runner.generator.idle_read,
        **_medians(conversations),
        "modes": by_mode,
        "prefix_cache": core.prefix_cache.snapshot(),
        "conversation_modes": ["chunk_start" if u else "last_token_pass" for u in used],
        "conversations": conversations,
    }


def _medians(conversations: list[list[dict[str, Any]]]) -> dict[str, Any]:
    cold = [t[0]["ttft_ms"] for t in conversations]
    warm = [x["ttft_ms"] for t in conversations for x in t[1:]]
    return {
        "cold_ttft_ms_median": statistics.median(cold),
        "warm_ttft_ms_median": statistics.median(warm) if warm else None,
        "speedup": round(statistics.median(cold) / statistics.median(warm), 3) if warm else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model", default=None)
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reply", type=int, default=64)
    ap.add_argument("--user", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--chunk-start", choices=("on", "off", "both"), default="on")
    ap.add_argument(
        "--reply-as",
        choices=("generated", "other"),
        default="generated",
        help="the next turn repeats the reply's tokens, or others (module doc)",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--sync", action="store_true", help="wait for the device after each stage (module doc)"
    )
    ap.add_argument(
        "--idle-read",
        choices=("on", "off"),
        default="on",
        help="read an idle step's first tokens before building the next pass (worker/fused.py)",
    )
    args = ap.parse_args(argv)

    from worker.backend import apply_env

    apply_env("auto")  # the worker's CUDA settings unless the environment has them
    from bench.models import shape_model

    model_dir = Path(args.model) if args.model else shape_model(args.shape)
    result = probe(model_dir, args)
    for c, turns in enumerate(result["conversations"]):
        for k, t in enumerate(turns):
            print(
                f"conversation {c} ({result['conversation_modes'][c]}) turn {k}: "
                f"{t['prompt_tokens']} tokens, {t['cached_tokens']} "
                f"cached, TTFT {t['ttft_ms']} ms (lookup {t['lookup_ms']} ms, insert "
                f"{t['insert_ms']} ms"
                + (f", queued before {t['queued_before_ms']} ms" if args.sync else "")
                + f"); steps {t['steps_to_first_token']}",
                flush=True,
            )
    for mode, m in result["modes"].items():
        print(
            f"{mode}: cold {m['cold_ttft_ms_median']} ms, warm {m['warm_ttft_ms_median']} ms: "
            f"{m['speedup']}x",
            flush=True,
        )
    if args.profile:
        print(
            f"-- the slowest warm turn ({result['profile_slowest_warm_ttft_ms']} ms)\n"
            f"{result['profile_slowest_warm']}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
