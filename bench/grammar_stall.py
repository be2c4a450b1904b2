"""Grammar-compile stalls: other users' inter-token gaps while large grammars compile.

    python -m bench.grammar_stall [--model DIR] [--neighbours 2] [--grammars 4]
                                  [--objects 1900] [--steady-s 3] [--out results.json]

Starts mlxd (bench/servers.py; the tiny random model when --model is left out),
then streams `--neighbours` long greedy completions (EOS banned) and records the
arrival time of every SSE chunk. After `--steady-s` seconds of steady decoding it
sends `--grammars` concurrent chat requests, each with a distinct large
`response_format` schema (an anyOf of `--objects` objects of six patterned
string fields: about 1.1 s of llguidance compilation each on the tiny model's
vocabulary), waits for them, lets the neighbours run one more second, and closes
them.

Reports the neighbours' inter-chunk gaps: p50/p99/max while only they ran
(steady) and while the grammars were in flight, and the ratio of the two p99s.
Issue 13's target: p99 during the grammars within 2x of steady. Before grammars
compiled off the engine thread, each compilation stalled every stream for its
whole duration.

Threading: client threads only; the server is a separate process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.servers import start_mlxd, stop


def large_schema(objects: int, variant: int) -> dict[str, Any]:
    """An anyOf of `objects` objects (under llguidance's 2,000-item row limit);
    `variant` changes every pattern, so no two requests share a grammar."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    f"key{i}_{j}": {"type": "string", "pattern": f"^[a-z]{{{j + 1}}}{i}v{variant}$"}
                    for j in range(6)
                },
                "required": [f"key{i}_0"],
                "additionalProperties": False,
            }
            for i in range(objects)
        ]
    }


def _neighbour(url: str, model: str, i: int, stop: threading.Event, arrivals: list[float]) -> None:
    body = {
        "model": model,
        "prompt": [5 + i, 6, 7, 8],
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "logit_bias": {"0": -100, "1": -100, "2": -100},
    }
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
            if stop.is_set():
                return  # closing the stream aborts the request


def grammar_body(model: str, schema: dict[str, Any]) -> bytes:
    """Encoded before the measurement: the client's own json.dumps of a 0.9 MB body
    holds this process's GIL, which would delay reading the neighbours' streams."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "fill it in"}],
        "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    return json.dumps(body).encode()


def _grammar_request(url: str, body: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=600,
    )
    return r.status_code, time.perf_counter() - start


def _probe_loop(url: str, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """Poll the gateway's /live: its latency is the event loop's lag (the worker
    plays no part), so a stall seen here and in the streams is the gateway's."""
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(f"{url}/live")
            samples.append((start, time.perf_counter() - start))
            time.sleep(0.005)


def _gap_stats(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {"n": 0}
    s = sorted(gaps)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {
        "n": len(s),
        "p50_ms": round(1000 * pick(0.50), 2),
        "p99_ms": round(1000 * pick(0.99), 2),
        "max_ms": round(1000 * s[-1], 2),
    }


def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    stop_flag = threading.Event()
    arrivals: list[list[float]] = [[] for _ in range(args.neighbours)]
    bodies = [grammar_body(model, large_schema(args.objects, v)) for v in range(args.grammars)]
    live: list[tuple[float, float]] = []
    with ThreadPoolExecutor(args.neighbours + args.grammars + 1) as pool:
        prober = pool.submit(_probe_loop, url, stop_flag, live)
        streams = [
            pool.submit(_neighbour, url, model, i, stop_flag, arrivals[i])
            for i in range(args.neighbours)
        ]
        time.sleep(args.steady_s)  # the steady window: neighbours alone
        g_start = time.perf_counter()
        answers = list(pool.map(lambda b: _grammar_request(url, b), bodies))
        g_end = time.perf_counter()
        time.sleep(1.0)
        stop_flag.set()
        for f in [*streams, prober]:
            f.result()
    steady: list[float] = []
    during: list[float] = []
    for times in arrivals:
        for a, b in itertools.pairwise(times):
            # Steady: after the first second (prefill, first chunks), before the grammars.
            if times[0] + 1.0 <= a and b < g_start:
                steady.append(b - a)
            elif b >= g_start and a <= g_end:
                during.append(b - a)
    worst = sorted(
        ((b - a, a - g_start) for times in arrivals for a, b in itertools.pairwise(times)),
        reverse=True,
    )[:5]
    st, du = _gap_stats(steady), _gap_stats(during)
    ratio = round(du["p99_ms"] / st["p99_ms"], 2) if st.get("p99_ms") and du.get("p99_ms") else None
    return {
        "grammar_statuses": [a[0] for a in answers],
        "grammar_latency_s": [round(a[1], 3) for a in answers],
        "grammar_window_s": round(g_end - g_start, 3),
        "live_probe_during_grammars": _gap_stats([d for t, d in live if g_start <= t <= g_end]),
        "live_probe_steady": _gap_stats([d for t, d in live if t < g_start]),
        "steady": st,
        "during_grammars": du,
        "p99_ratio": ratio,
        # (gap, its start relative to the grammars' start), seconds: where stalls fall
        "worst_gaps": [[round(g, 4), round(t, 3)] for g, t in worst],
        "target_p99_ratio": 2.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grammar_stall", description=__doc__)
    p.add_argument("--model", default="", help="model directory (default: tiny random model)")
    p.add_argument("--neighbours", type=int, default=2)
    p.add_argument("--grammars", type=int, default=4)
    p.add_argument("--objects", type=int, default=1900)
    p.add_argument("--steady-s", type=float, default=3.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxd-grammar-stall-") as work:
        model = Path(args.model) if args.model else None
        if model is None:
            from worker.modelfiles.random_model import make_random_model

            model = make_random_model(Path(work) / "tiny", seed=0)
        server = start_mlxd(model, Path(work), max_batch=8)
        try:
            result = {
                "model": args.model or "tiny random (seed 0)",
                **measure(server.url, server.model, args),
            }
        finally:
            stop(server)
    result["settings"] = vars(args)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    st, du = result["steady"], result["during_grammars"]
    print(
        f"steady p99 {st.get('p99_ms')} ms, during {args.grammars} grammars p99 "
        f"{du.get('p99_ms')} ms (max {du.get('max_ms')} ms): ratio {result['p99_ratio']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
