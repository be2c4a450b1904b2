"""Constrained decoding overhead: the same workload plain, constrained and mixed, in one run.

    python -m bench.constrained --model DIR [--requests 16] [--concurrency 8]
                                [--max-tokens 64] [--rounds 3] [--out results.json]

Starts mlxd on DIR (bench/servers.py), then runs three phases of `--requests`
chat requests at `--concurrency`, each generating exactly `--max-tokens` tokens:
`plain`, `json_schema` (every request constrained by a schema too long to finish
within max_tokens, so both phases produce the same number of tokens) and
`mixed` (half of each in one batch: what constrained neighbours cost plain rows).
Reports aggregate completion tokens per second per phase and the overhead of
each against plain. EOS is banned with a logit bias in every phase so plain
requests run to max_tokens as well.

Threading: client threads only; the server is a separate process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.servers import start_mlxd, stop

# At least 40 items of up to 12 characters: never complete within 64 tokens.
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "n": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "n"],
                "additionalProperties": False,
            },
            "minItems": 40,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def _request(
    url: str, model: str, i: int, constrained: bool, max_tokens: int, eos: list[int]
) -> int:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Request {i}: describe some things."}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": i,
        "logit_bias": {str(t): -100 for t in eos},
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "things", "schema": LONG_SCHEMA},
        }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def run_phase(
    url: str,
    model: str,
    kinds: list[bool],
    concurrency: int,
    max_tokens: int,
    eos: list[int],
) -> dict[str, Any]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = list(
            pool.map(lambda a: _request(url, model, a[0], a[1], max_tokens, eos), enumerate(kinds))
        )
    wall = time.perf_counter() - start
    return {
        "requests": len(kinds),
        "constrained": sum(kinds),
        "completion_tokens": sum(tokens),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(tokens) / wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.constrained", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxd-constrained-") as work:
        server = start_mlxd(Path(args.model), Path(work), max_batch=max(8, args.concurrency))
        try:
            from mlx_lm.tokenizer_utils import load as load_tokenizer

            eos = sorted(int(t) for t in load_tokenizer(Path(args.model)).eos_token_ids)
            n = args.requests
            common = (args.concurrency, args.max_tokens, eos)
            run_phase(server.url, server.model, [False, True] * 2, *common)  # warm-up
            kinds = {
                "plain": [False] * n,
                "json_schema": [True] * n,
                "mixed": [i % 2 == 1 for i in range(n)],
            }
            # Rounds interleave the phases so drift in machine load hits all alike;
            # each phase reports its median round.
            rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
            for _ in range(args.rounds):
                for name, ks in kinds.items():
                    rounds[name].append(run_phase(server.url, server.model, ks, *common))
            phases = {}
            for name, rs in rounds.items():
                ordered = sorted(rs, key=lambda r: r["tokens_per_s"])
                phases[name] = {
                    **ordered[len(ordered) // 2],
                    "rounds_tokens_per_s": [r["tokens_per_s"] for r in rs],
                }
        finally:
            stop(server)
    base = phases["plain"]["tokens_per_s"]
    for ph in phases.values():
        ph["overhead_vs_plain"] = round(1 - ph["tokens_per_s"] / base, 3) if base else None
    result = {
        "model": args.model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "phases": phases,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    for name, ph in phases.items():
        print(
            f"{name:12s} {ph['tokens_per_s']:8.1f} tok/s  overhead {ph['overhead_vs_plain']:+.1%}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
