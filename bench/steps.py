"""mlxd's own steps beside a scenario's client-side timeline (the worker's step
trace, worker/step_trace.py).

`bench run --step-trace` and `bench trace` start mlxd with `MLXD_STEP_TRACE`
set to `<out>/mlxd-steps`; the worker writes one JSON line per engine step
there. Both clocks are CLOCK_MONOTONIC on one host, so a scenario's request
times (relative to its `t0`) and the worker's step ends line up without any
matching. `mixed_pressure_steps` picks the steps from the long prompt's
arrival to just past its first token: the paced steps whose cost the
mixed-pressure targets judge, with the chunk the planner chose and the cost
it predicted.

`python -m bench.steps OUT` prints that table for a finished run's folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STEPS_DIR = "mlxd-steps"
STEP_TRACE_ENV = "MLXD_STEP_TRACE"
# Steps after the long prompt's first token still shown: the step that
# reported it, and one decode step for scale.
_AFTER_FIRST_S = 0.05


def load_steps(directory: Path) -> list[dict[str, Any]]:
    """Every step of every worker that wrote into `directory`, in time order."""
    steps: list[dict[str, Any]] = []
    for path in sorted(directory.glob("steps-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                steps.append(json.loads(line))
            except ValueError:
                continue  # a torn last line: the worker was killed mid-write
    steps.sort(key=lambda s: s.get("t", 0.0))
    return steps


def mixed_pressure_steps(
    results: dict[str, Any], steps: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """mlxd's steps from the long prompt's arrival to just past its first token,
    each with `at_ms` (its end, after the arrival) and `period_ms` (since the
    step before it ended: what a stream waited for that step's token)."""
    scen = (((results.get("targets") or {}).get("mlxd") or {}).get("scenarios") or {}).get(
        "mixed_pressure"
    ) or {}
    extra = scen.get("extra") or {}
    t0, arrival, long_id = scen.get("t0"), extra.get("arrival"), extra.get("long_id")
    if t0 is None or arrival is None or not steps:
        return []
    first = None
    for wave in scen.get("waves") or []:
        for r in wave.get("requests") or []:
            if r.get("id") == long_id:
                first = r.get("first_token")
    start = t0 + arrival
    end = t0 + (first if first is not None else arrival + 1.0) + _AFTER_FIRST_S
    out, before = [], None
    for s in steps:
        t = s.get("t", 0.0)
        if t < start:
            before = t
            continue
        if t > end:
            break
        period = None if before is None else round((t - before) * 1e3, 2)
        out.append({**s, "at_ms": round((t - start) * 1e3, 2), "period_ms": period})
        before = t
    return out


def steps_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines for `mixed_pressure_steps`' rows."""
    if not rows:
        return []
    lines = [
        "| at (ms after arrival) | period ms | step ms | predicted ms | insert ms | decoding | "
        "prompt tokens | chunk | kv | admitted | fused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['at_ms']:.1f} | {_ms(r.get('period_ms'))} | {r.get('s', 0) * 1e3:.2f} | "
            f"{r.get('predicted_s', 0) * 1e3:.2f} | {r.get('admit_s', 0) * 1e3:.2f} | "
            f"{r.get('decoding', 0)} | "
            f"{r.get('prompt_tokens', 0)} | {r.get('chunk', 0)} | {r.get('kv', 0)} | "
            f"{r.get('admitted', 0)} | {'yes' if r.get('fused') else 'no'} |"
        )
    return lines


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.steps OUT (a bench run folder)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    results = json.loads((out / "results.json").read_text())
    rows = mixed_pressure_steps(results, load_steps(out / STEPS_DIR))
    if not rows:
        print("no mixed-pressure steps: run with --step-trace and mixed_pressure", file=sys.stderr)
        return 1
    print("\n".join(steps_table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
