"""`bench compare BASE.json CAND.json`: did a change make mlxd faster or slower?

Owns the comparison of two results files:
- refuses (exit 2) unless both ran the same workload (digest of every request,
  preset and seed) on the same model identity, and both have the target;
- token parity: greedy requests that completed in both should have produced
  the same tokens (token ids where both have them, else text); by default any
  mismatch fails the comparison (exit 1), because then the runs did different
  work. bf16 on a GPU is not batch-invariant (a row's numerics depend on its
  batch neighbours), so there greedy outputs of random-weight models drift;
  `--min-parity` lowers the bar, and the report shows how far they agree;
- per scenario and metric, the relative change of the mean with a 95% bootstrap
  interval over per-request (or per-wave) values. A metric regresses when the
  whole interval lies on the worse side of zero and the change is worse than
  `threshold`; it improves symmetrically; otherwise it has no significant change.
Exit 1 on any regression or parity failure, else 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.analysis import records
from bench.client import RequestRecord
from bench.stats import bootstrap_relative_change, mean

# (name, higher is better) per scenario kind; values come from `_values`.
METRICS: dict[str, list[tuple[str, bool]]] = {
    "sweep": [("tok_s", True), ("ttft", False), ("itl", False), ("e2e", False)],
    "nonstream": [("e2e", False)],
    "long_prefill": [("ttft", False)],
    "sustained": [("tok_s", True), ("itl", False)],
    "shared_prefix": [("ttft_cold", False), ("ttft_warm", False)],
    "mixed": [("itl", False), ("ttft", False)],
    "slow_readers": [("itl", False)],
    "cancel": [("cancel_to_retire", False)],
}


def _values(kind: str, metric: str, result: dict[str, Any]) -> list[float]:
    recs = records(result)
    extra = result.get("extra") or {}
    bg = set(extra.get("background_ids", [])) | set(extra.get("slow_ids", []))
    if kind == "mixed":
        long_id = extra.get("long_id")
        recs = [r for r in recs if (r.id == long_id) == (metric == "ttft")]
    recs = [r for r in recs if r.id not in bg]
    done = [r for r in recs if r.ok and r.cancelled_at is None]
    if metric == "tok_s":
        waves = result["waves"]
        if len(waves) > 1:
            return [
                sum(int(q["tokens"]) for q in w["requests"]) / w["wall_s"]
                for w in waves
                if w["wall_s"] > 0
            ]
        return [
            r.tokens / (r.done - r.first_token)
            for r in done
            if r.done is not None and r.first_token is not None and r.done > r.first_token
        ]
    if metric.startswith("ttft"):
        if metric == "ttft_cold":
            done = [r for r in done if r.id.endswith("/t0")]
        elif metric == "ttft_warm":
            done = [r for r in done if not r.id.endswith("/t0")]
        return [r.first_token - r.sent for r in done if r.first_token is not None]
    if metric == "itl":
        return [m for r in done if (m := mean(r.gaps())) is not None]
    if metric == "e2e":
        return [r.done - r.sent for r in done if r.done is not None]
    if metric == "cancel_to_retire":
        return [r.cancel_to_retire_s for r in recs if r.cancel_to_retire_s is not None]
    raise ValueError(metric)


def _parity(base: dict[str, Any], cand: dict[str, Any]) -> dict[str, Any]:
    """Identical greedy outputs, and how far the others agree (common prefix, length)."""

    def done(target: dict[str, Any]) -> dict[str, RequestRecord]:
        out = {}
        for res in (target.get("scenarios") or {}).values():
            for r in records(res):
                if r.ok and r.cancelled_at is None and r.finish_reason is not None:
                    out[r.id] = r
        return out

    a, b = done(base), done(cand)
    compared, mismatches, prefixes, same_length = 0, [], [], 0
    for rid in sorted(a.keys() & b.keys()):
        x, y = a[rid], b[rid]
        u: Any = x.token_ids if x.token_ids is not None and y.token_ids is not None else x.text
        v: Any = y.token_ids if x.token_ids is not None and y.token_ids is not None else y.text
        compared += 1
        same_length += x.tokens == y.tokens
        n = next(
            (i for i, (p, q) in enumerate(zip(u, v, strict=False)) if p != q), min(len(u), len(v))
        )
        prefixes.append(n / max(len(u), len(v), 1))
        if u != v:
            mismatches.append(rid)
    return {
        "compared": compared,
        "mismatches": len(mismatches),
        "first": mismatches[:10],
        "identical_fraction": (compared - len(mismatches)) / compared if compared else 1.0,
        "mean_common_prefix": mean(prefixes),
        "same_token_count": same_length,
    }


def compare(
    base: dict[str, Any],
    cand: dict[str, Any],
    *,
    target: str = "mlxd",
    threshold: float = 0.05,
    min_parity: float = 1.0,
) -> dict[str, Any]:
    """The comparison as data; `refused` set when the runs cannot be compared."""
    refused = []
    if base["workload"]["digest"] != cand["workload"]["digest"]:
        refused.append(
            f"different workloads: {base['workload']['digest']} vs "
            f"{cand['workload']['digest']} (preset, seed or model tokenizer differ)"
        )
    if base["model"]["identity"] != cand["model"]["identity"]:
        refused.append(
            f"different models: {base['model']['identity']} vs {cand['model']['identity']}"
        )
    tb = (base.get("targets") or {}).get(target)
    tc = (cand.get("targets") or {}).get(target)
    if tb is None or tc is None:
        refused.append(
            f"target {target!r} missing from "
            + (
                "both"
                if tb is None and tc is None
                else "the base"
                if tb is None
                else "the candidate"
            )
        )
    if refused:
        return {"refused": refused}
    assert tb is not None and tc is not None
    rows = []
    for name, rb in (tb.get("scenarios") or {}).items():
        rc = (tc.get("scenarios") or {}).get(name)
        if rc is None:
            continue
        kind = rb["kind"]
        for metric, higher_better in METRICS.get(kind, []):
            vb, vc = _values(kind, metric, rb), _values(kind, metric, rc)
            ci = bootstrap_relative_change(vb, vc)
            rows.append(
                {
                    "scenario": name,
                    "metric": metric,
                    "higher_is_better": higher_better,
                    "base_mean": mean(vb),
                    "cand_mean": mean(vc),
                    "n_base": len(vb),
                    "n_cand": len(vc),
                    "change": None if ci is None else ci[0],
                    "ci_low": None if ci is None else ci[1],
                    "ci_high": None if ci is None else ci[2],
                    "verdict": _verdict(ci, higher_better, threshold),
                }
            )
    parity = _parity(tb, tc)
    regressions = [r for r in rows if r["verdict"] == "regression"]
    improvements = [r for r in rows if r["verdict"] == "improvement"]
    if parity["identical_fraction"] < min_parity:
        overall = "TOKEN PARITY FAILED"
    elif regressions:
        overall = "REGRESSION"
    elif improvements:
        overall = "IMPROVEMENT"
    else:
        overall = "NO SIGNIFICANT CHANGE"
    return {
        "refused": [],
        "rows": rows,
        "parity": parity,
        "verdict": overall,
        "threshold": threshold,
        "min_parity": min_parity,
        "target": target,
    }


def _verdict(ci: tuple[float, float, float] | None, higher_better: bool, threshold: float) -> str:
    if ci is None:
        return "not enough data"
    point, low, high = ci
    worse = (high < 0 and point < -threshold) if higher_better else (low > 0 and point > threshold)
    better = (low > 0 and point > threshold) if higher_better else (high < 0 and point < -threshold)
    if worse:
        return "regression"
    if better:
        return "improvement"
    return "no significant change"


def markdown(result: dict[str, Any], base: Path, cand: Path) -> str:
    lines = [f"# bench compare: `{base}` -> `{cand}`", ""]
    if result["refused"]:
        lines += ["Refused: these runs cannot be compared.", ""]
        lines += [f"- {r}" for r in result["refused"]]
        return "\n".join(lines) + "\n"
    p = result["parity"]
    lines += [
        f"**Verdict: {result['verdict']}** (target {result['target']}, threshold "
        f"{result['threshold']:.0%}, 95% bootstrap intervals of the change of the mean)",
        "",
        f"Token parity: {p['compared'] - p['mismatches']}/{p['compared']} greedy requests "
        f"identical (required: {result['min_parity']:.0%}); same token count "
        f"{p['same_token_count']}/{p['compared']}; mean common prefix "
        f"{(p['mean_common_prefix'] or 0):.1%}"
        + (f"; mismatches: {', '.join(p['first'])}" if p["mismatches"] else ""),
        "",
        "| scenario | metric | base mean | candidate mean | change | 95% CI | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        unit = 1.0 if r["metric"] == "tok_s" else 1e3
        ch = "-" if r["change"] is None else f"{r['change']:+.1%}"
        ci = "-" if r["ci_low"] is None else f"[{r['ci_low']:+.1%}, {r['ci_high']:+.1%}]"
        lines.append(
            f"| {r['scenario']} | {r['metric']}{'' if unit == 1.0 else ' (ms)'} | "
            f"{_num(r['base_mean'], unit)} | {_num(r['cand_mean'], unit)} | {ch} | {ci} "
            f"| {r['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def _num(v: float | None, unit: float) -> str:
    return "-" if v is None else f"{v * unit:.2f}"


def compare_files(
    base: Path,
    cand: Path,
    *,
    target: str = "mlxd",
    threshold: float = 0.05,
    min_parity: float = 1.0,
    out: Path | None = None,
) -> int:
    try:
        b = json.loads(base.read_text())
        c = json.loads(cand.read_text())
    except (OSError, ValueError) as e:
        print(f"bench compare: {e}", file=sys.stderr)
        return 2
    result = compare(b, c, target=target, threshold=threshold, min_parity=min_parity)
    text = markdown(result, base, cand)
    sys.stdout.write(text)
    if out is not None:
        out.write_text(text)
    if result["refused"]:
        return 2
    return 1 if result["verdict"] in ("REGRESSION", "TOKEN PARITY FAILED") else 0
