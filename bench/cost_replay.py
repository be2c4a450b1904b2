"""The prefill cost model replayed over recorded step traces, with no device.

    python -m bench.cost_replay TRACE [TRACE ...] [--variants base,no-admit,...]
                                [--json OUT]

A TRACE is a worker step trace (`steps-<pid>.jsonl`, worker/step_trace.py), a
directory holding some, or a `mlxd-steps.tar.xz` as the GPU jobs keep them
(docs/benchmarks/h200-*/). Each trace is fed, step by step, to a fresh
`Scheduler` as the engine feeds it (`observe_step` for every step the trace
marks `learned`), and before each paced step (prompt tokens beside decode
rows, past the warm-up) the replay asks what the planner would have been
told: the step's predicted seconds (the decode unit plus the paced pass's
cost, `Scheduler.predicted_step_s`) against what the step took. So a change
to what the model learns can be priced on the H200's own steps between GPU
sessions. The GPU's time is what the planner spends: a model that predicts
a 256-token fused step at 21-24 ms where it took 13-14 (session 26's
llama8b traces) plans 256-token steps where the gap target had room for
more.

Variants (what the replayed scheduler learns; `base` is the worker's rule
without `admission_cost`, as it ran before session 32, `admit-term` the
rule with it, the worker's default since):
- `base`: every learned step.
- `no-admit`: not the steps that admitted a request (their prefix-cache
  copy, and with `reserve` the allocation of the whole prompt's KV, are
  costs of the admission, not of the pass).
- `decode-median`: a paced pass's cost is the step less the median of the
  last eight decode-only steps, not less their moving average (a decode
  step moves by several ms from step to step on the H200; the pass's own
  cost is the smaller difference of the two).
- `no-admit+decode-median`: both.
- `admit-term@next`: `admit-term`, scored against the next step's seconds
  instead of the step's own. The worker queues a step's pass and returns,
  and the next step reads that pass's tokens back: in a pipelined engine a
  pass's device time shows in the next step's period, which is what the
  streams wait (session 36: a 455-token last chunk took 15.1 ms as
  measured, its next step 33.4).
- `lag`: `admit-term` taught each paced step's shape with the next step's
  seconds (the period its pass caused), and scored against them; decode
  steps teach the decode estimate their own, as consecutive ones cost
  alike. Over session 36's ten traces (376 paced steps; both shapes, H100
  and H200) the mean absolute log error was 0.221 for `admit-term`, 0.471
  for `admit-term@next` and 0.482 for `lag` (0.009 on a synthetic trace
  built pipelined, tests/test_bench.py): a paced step's own duration
  follows its own shape, and the next step's does not, so the worker keeps
  the step's own.
- `admit-term`: the worker's `admission_cost` setting (worker/scheduler.py):
  the model as `base`, plus a cost per admitted request that a step which
  admits pays on top of its pass, the median over the last 16 admitting
  paced steps of what each took beyond the model's prediction, per request
  (session 31: on both shapes' traces such steps took about 1.6x their
  prediction, while paced steps without an admission came within a few
  percent).

Each summary also prices the admitting steps on their own (`admitting_*`):
the streams' p99 gap under mixed pressure is the step that admits the long
prompt on both shapes (session 31). And it counts the passes beside decode
rows the model held when it priced the first paced step, and the fewest it
held at any (`beside_passes_*`): over sessions 36-40's GPU traces the first
was one or two in all eight 0.5B runs and none or one in three of the
twenty 8B runs (session 41), and a fixed cost fitted to so few is their
noise (worker/scheduler.py, `MIN_KIND_PASSES`).

Traces written before session 26 lack `pass_chunk` (the length a pass's
rows are padded to): the replay then takes `min(chunk, pass tokens)`,
exact for one row (every mixed-pressure prompt) and too long for a pass of
several rows (a burst), so a replay of such a trace drifts from what its
worker predicted once bursts taught the model (`approximate` in the
output).

Owns nothing the worker runs; pure Python over the traces.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import sys
import tarfile
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.scheduler import BESIDE, Scheduler, SchedulerConfig

VARIANTS = (
    "base",
    "no-admit",
    "decode-median",
    "no-admit+decode-median",
    "admit-term",
    "admit-term@next",
    "lag",
)
_DECODE_WINDOW = 8


def read_traces(path: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(name, steps) of every trace file at `path` (a file, a directory, a tarball)."""
    if path.is_dir():
        for f in sorted(path.rglob("*")):
            if f.is_file() and (f.suffix == ".jsonl" or f.name.endswith(".tar.xz")):
                yield from read_traces(f)
        return
    if path.name.endswith(".tar.xz"):
        with tarfile.open(path, "r:xz") as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".jsonl"):
                    data = tar.extractfile(member)
                    if data is not None:
                        text = io.TextIOWrapper(data, encoding="utf-8")
                        yield f"{path}:{member.name}", _parse(text)
        return
    with path.open(encoding="utf-8") as lines:
        yield str(path), _parse(lines)


def _parse(lines: Iterable[str]) -> list[dict[str, Any]]:
    steps = (json.loads(line) for line in lines if line.strip())
    return [s for s in steps if "decoding" in s and "s" in s]  # step lines only


@dataclass
class Replay:
    """One variant over one trace: each paced step's (predicted, took)
    seconds, and what the worker itself predicted for it (`worker`: the
    trace's `predicted_s`; a faithful replay of `base` reproduces it)."""

    variant: str
    pairs: list[tuple[float, float]] = field(default_factory=list)
    worker: list[float] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # requests each paced step admitted
    # passes beside decode rows the model held when it priced each paced step
    # (a kind's own fixed cost needs worker/scheduler.py's MIN_KIND_PASSES)
    beside: list[int] = field(default_factory=list)
    approximate: bool = False  # the trace lacks `pass_chunk` (module doc)

    def fidelity(self) -> float | None:
        """Median relative difference between this replay's predictions and
        the worker's own (meaningful for `base`)."""
        diffs = [abs(p - w) / w for (p, _), w in zip(self.pairs, self.worker, strict=True) if w > 0]
        return statistics.median(diffs) if diffs else None

    def summary(self) -> dict[str, Any]:
        if not self.pairs:
            return {"variant": self.variant, "paced_steps": 0}
        fidelity = self.fidelity()
        admitting = [pt for pt, n in zip(self.pairs, self.admitted, strict=True) if n]
        return {
            "variant": self.variant,
            "paced_steps": len(self.pairs),
            "approximate": self.approximate,
            "replay_vs_worker_p50": None if fidelity is None else round(fidelity, 4),
            **_errors(self.pairs),
            "admitting_steps": len(admitting),
            **{f"admitting_{k}": v for k, v in _errors(admitting).items()},
            "beside_passes_first": self.beside[0],
            "beside_passes_min": min(self.beside),
        }


def _errors(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """How far (predicted, took) pairs miss: the median ratio, the mean absolute
    log error, and the share within 20%."""
    ratios = [p / t for p, t in pairs if p > 0 and t > 0]
    if not ratios:
        return {"predicted_over_took_p50": None, "abs_log_error_mean": None, "within_20pct": None}
    logs = [abs(math.log(r)) for r in ratios]
    return {
        "predicted_over_took_p50": round(statistics.median(ratios), 3),
        "abs_log_error_mean": round(statistics.fmean(logs), 3),
        "within_20pct": round(sum(1 for r in ratios if 0.8 <= r <= 1.2) / len(ratios), 3),
    }


def replay(steps: list[dict[str, Any]], variant: str = "base") -> Replay:
    """Feed `steps` to a fresh Scheduler as the engine does, under `variant`."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    skip_admit = "no-admit" in variant
    median_decode = "decode-median" in variant
    admit_term = "admit-term" in variant or variant == "lag"
    sched: Scheduler[Any] = Scheduler(SchedulerConfig(admission_cost=admit_term))
    recent: deque[float] = deque(maxlen=_DECODE_WINDOW)
    out = Replay(variant)
    for i, step in enumerate(steps):
        decoding, prompt = int(step["decoding"]), int(step["prompt_tokens"])
        tokens, kv = int(step.get("pass_tokens", 0)), int(step.get("kv", 0))
        length = step.get("pass_chunk", min(int(step["chunk"]), tokens))
        shape = (tokens, kv, int(length)) if tokens else (0, 0, 0)
        seconds = scored = float(step["s"])
        paced = decoding > 0 and prompt > 0 and tokens > 0
        if variant in ("lag", "admit-term@next"):
            if i + 1 == len(steps):
                break
            scored = float(steps[i + 1]["s"])
            if variant == "lag" and paced:
                seconds = scored  # decode steps still teach their own (module doc)
        out.approximate = out.approximate or (tokens > 0 and "pass_chunk" not in step)
        admitted = int(step.get("admitted", 0))
        if paced and not step.get("warmup") and sched.cost.ready:
            out.pairs.append((sched.predicted_step_s(decoding, shape, admitted), scored))
            out.worker.append(float(step.get("predicted_s", 0.0)))
            out.admitted.append(admitted)
            out.beside.append(sum(1 for f, _ in sched.cost.samples if f[BESIDE]))
        if not step.get("learned", True):
            continue
        if decoding and not prompt:
            recent.append(seconds)
        if paced and skip_admit and admitted:
            continue
        if paced and median_decode and recent:
            # The scheduler learns seconds less its decode estimate: hand it
            # the step with that estimate swapped for the recent median.
            estimate = sched.decode_step_s.value
            if estimate is not None:
                seconds = seconds - statistics.median(recent) + estimate
        sched.observe_step(seconds, decoding, prompt, shape, admitted)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost_replay", description=__doc__)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    rows: list[dict[str, Any]] = []
    for path in args.traces:
        for name, steps in read_traces(path):
            for v in variants:
                summary = replay(steps, v).summary()
                if summary["paced_steps"]:
                    rows.append({"trace": name, **summary})
    print(
        "| trace | variant | paced steps | predicted/took p50 | mean abs log error | "
        "within 20% | admitting steps | their predicted/took p50 | their mean abs log error | "
        "replay/worker differ, p50 | passes beside decode rows learned, first / min |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        approx = " (approximate)" if r["approximate"] else ""
        print(
            f"| {r['trace']}{approx} | {r['variant']} | {r['paced_steps']} | "
            f"{r['predicted_over_took_p50']} | {r['abs_log_error_mean']} | {r['within_20pct']} | "
            f"{r['admitting_steps']} | {r['admitting_predicted_over_took_p50']} | "
            f"{r['admitting_abs_log_error_mean']} | {r['replay_vs_worker_p50']} | "
            f"{r['beside_passes_first']} / {r['beside_passes_min']} |"
        )
    for v in variants:
        mine = [r for r in rows if r["variant"] == v and r["abs_log_error_mean"] is not None]
        if mine:
            count = sum(r["paced_steps"] for r in mine)
            err = sum(r["abs_log_error_mean"] * r["paced_steps"] for r in mine) / count
            p50 = statistics.median(r["predicted_over_took_p50"] for r in mine)
            print(
                f"{v}: {len(mine)} traces, {count} paced steps, mean abs log error {err:.3f}, "
                f"median of the traces' predicted/took {p50:.3f}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
