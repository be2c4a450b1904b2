"""The longest run of decode-only steps at a fixed batch size in each step trace.

    python docs/benchmarks/session36/steady_steps.py DIR [DIR ...] [--rows 16]

Each DIR holds a run's `mlxd-steps.tar.xz` (the worker's step trace). For the
longest unbroken run of decode-only steps with `--rows` rows decoding (the
mixed-pressure streams before the long prompt arrives, then sustained
decode), prints the mean step, the median of each 50 steps in order, and the
steps above 1.3x the run's median (index in the run, ms): session 36's
comparison of `decode_rows` on and off, and where buffers grew.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
from pathlib import Path


def steps_of(run_dir: Path) -> list[dict]:
    with tarfile.open(run_dir / "mlxd-steps.tar.xz") as tar:
        for member in tar.getmembers():
            if member.name.endswith(".jsonl"):
                f = tar.extractfile(member)
                assert f is not None
                lines = io.TextIOWrapper(f).read().splitlines()
                return [s for s in map(json.loads, lines) if not s.get("warmup")]
    return []


def longest_run(steps: list[dict], rows: int) -> list[float]:
    best: list[float] = []
    current: list[float] = []
    for s in steps:
        if s["prompt_tokens"] == 0 and s["decoding"] == rows:
            current.append(1e3 * s["s"])
            continue
        best = max(best, current, key=len)
        current = []
    return max(best, current, key=len)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    for d in args.dirs:
        ms = longest_run(steps_of(d), args.rows)
        if not ms:
            print(f"{d.name}: no such run")
            continue
        med = statistics.median(ms)
        blocks = [round(statistics.median(ms[i : i + 50]), 1) for i in range(0, len(ms), 50)]
        slow = [(i, round(m, 1)) for i, m in enumerate(ms) if m > 1.3 * med]
        print(f"{d.name}: {len(ms)} steps, mean {statistics.mean(ms):.2f} ms, median {med:.2f}")
        print(f"  per 50: {blocks}")
        print(f"  above 1.3x the median ({len(slow)}): {slow[:24]}")


if __name__ == "__main__":
    main()
