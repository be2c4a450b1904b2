"""From raw request records to the numbers the report states.

Owns every derived metric: per scenario and target the TTFT, inter-token gap and
end-to-end percentiles, aggregate output tokens/s and requests/s, the
kind-specific facts (mixed-pressure windows, cold vs warm shared-prefix TTFT,
cancellation-to-retirement, slow readers), the ratios between targets
(engine/ceiling: what mlxd's worker core costs over the raw BatchGenerator;
mlxd/engine: what the serving path costs over that core; mlxd/ceiling and
mlxd/peer end to end), token parity, and the checks against issue #6's
targets.

Definitions:
- TTFT: first token event - request sent. Non-streaming requests have none.
- inter-token gap (ITL): time between consecutive token-bearing SSE events of
  one request (ceiling: between the next() calls that gave it a token; engine:
  between the core.step() calls that did).
- E2E: done - sent, for requests that completed (not cancelled).
- tokens/s: output tokens of all requests / the summed wall time of the
  scenario's waves (first request sent to last request done).
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from bench.client import RequestRecord
from bench.stats import mean, percentile, ratio, summary_ms

# Report order: from the raw engine outwards, then the peer.
TARGETS = ("ceiling", "ceiling_alt", "engine", "mlxd", "peer")
# The concurrency levels issue #6 names for the overhead target.
OVERHEAD_LEVELS = (1, 8, 32, 64)
OVERHEAD_MIN = 0.95
MIXED_ITL_MAX = 2.0
MIXED_TTFT_MAX = 1.5
CANCEL_SLACK_S = 0.005
PREFIX_SPEEDUP_MIN = 5.0
MEMORY_TOLERANCE_BYTES = 1 << 20


def records(result: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_json(r) for w in result["waves"] for r in w["requests"]]


def _ttfts(recs: list[RequestRecord]) -> list[float]:
    return [
        r.first_token - r.sent
        for r in recs
        if r.first_token is not None and r.cancelled_at is None and len(r.events) > 0 and r.ok
    ]


def _gaps(recs: list[RequestRecord]) -> list[float]:
    return [g for r in recs for g in r.gaps()]


def _e2e(recs: list[RequestRecord]) -> list[float]:
    return [r.done - r.sent for r in recs if r.ok and r.done is not None and r.cancelled_at is None]


def basic(
    recs: list[RequestRecord],
    wall_s: float,
    wave_walls: list[float] | None = None,
    wave_tokens: list[int] | None = None,
    streaming: bool = True,
) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    tokens = sum(r.tokens for r in recs)
    out: dict[str, Any] = {
        "requests": len(recs),
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "error_samples": [f"{r.id}: {r.error}" for r in recs if not r.ok][:3],
        "output_tokens": tokens,
        "wall_s": round(wall_s, 4),
        "tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "req_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "ttft_ms": summary_ms(_ttfts(recs)) if streaming else summary_ms([]),
        "itl_ms": summary_ms(_gaps(recs)) if streaming else summary_ms([]),
        "e2e_ms": summary_ms(_e2e(recs)),
    }
    if wave_walls is not None and wave_tokens is not None:
        out["wave_tok_s"] = [
            round(t / w, 2) for t, w in zip(wave_tokens, wave_walls, strict=True) if w > 0
        ]
        out["tok_s_spread"] = relative_spread(out["wave_tok_s"])
    return out


def relative_spread(values: list[float]) -> float | None:
    """The 95% half-width of the mean of `values`, relative to it (normal
    approximation over waves); None under two values."""
    if len(values) < 2 or not statistics.fmean(values):
        return None
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values))
    return round(half / statistics.fmean(values), 4)


def ratio_spread(a: dict[str, Any], b: dict[str, Any], paired: bool = False) -> float | None:
    """The 95% half-width of tok_s(a) / tok_s(b), relative to the ratio.

    Unpaired: the two targets' wave-to-wave spreads, added in quadrature. Paired
    (an interleaved run, where wave i of both ran seconds apart): the spread of
    the per-wave ratios themselves (on their logarithms), which drops what
    both waves of a pair shared (their prompts, the machine's state then).
    """
    wa, wb = a.get("wave_tok_s") or [], b.get("wave_tok_s") or []
    if paired and len(wa) == len(wb) >= 2 and min(wa + wb) > 0:
        logs = [math.log(x / y) for x, y in zip(wa, wb, strict=True)]
        return round(math.expm1(1.96 * statistics.stdev(logs) / math.sqrt(len(logs))), 4)
    sa, sb = a.get("tok_s_spread"), b.get("tok_s_spread")
    if sa is None or sb is None:
        return None
    return round(math.hypot(sa, sb), 4)


def waves_for(spread: float | None, waves: int, goal: float) -> int | None:
    """Waves a ratio needs for a 95% half-width of `goal`, from one run's
    `spread` over `waves` waves: the half-width falls as 1/sqrt(waves)."""
    if spread is None or waves < 2 or goal <= 0:
        return None
    return max(waves, math.ceil(waves * (math.log1p(spread) / math.log1p(goal)) ** 2))


def wave_seconds(results: dict[str, Any]) -> dict[str, float]:
    """Per scenario, the mean seconds one wave took on every target together
    (an interleaved run's log): what one more wave of that level costs."""
    walls: dict[tuple[str, str], list[float]] = {}
    for w in (results.get("interleave") or {}).get("waves") or []:
        walls.setdefault((w["scenario"], w["target"]), []).append(w["end"] - w["start"])
    out: dict[str, float] = {}
    for (scen, _), ws in walls.items():
        out[scen] = out.get(scen, 0.0) + statistics.fmean(ws)
    return out


def paired_run(results: dict[str, Any]) -> bool:
    """Whether every target's waves were interleaved in this one run (none merged
    from an earlier run into the same directory), so spreads may pair waves."""
    logged = {w["target"] for w in (results.get("interleave") or {}).get("waves") or []}
    return bool(logged) and set(results.get("targets") or {}) <= logged


def summarize_scenario(
    name: str, result: dict[str, Any], idle_long_ttft_s: float | None = None
) -> dict[str, Any]:
    out = _summarize_kind(result, idle_long_ttft_s)
    cpu = cpu_per_token(result)
    if cpu:
        out["cpu_us_per_token"] = cpu
    return out


def cpu_per_token(result: dict[str, Any]) -> dict[str, float]:
    """Microseconds of CPU each of the target's processes spent per output token
    over the scenario (bench/scenarios.py `cpu_s`): what serving one token costs
    the gateway, the worker, or the peer's one process. {} without tokens or CPU."""
    tokens = sum(int(r["tokens"]) for w in result.get("waves", []) for r in w["requests"])
    cpu = result.get("cpu_s") or {}
    if tokens <= 0:
        return {}
    return {k: round(float(v) * 1e6 / tokens, 1) for k, v in cpu.items()}


def _summarize_kind(result: dict[str, Any], idle_long_ttft_s: float | None) -> dict[str, Any]:
    kind = result["kind"]
    waves = result["waves"]
    walls = [float(w["wall_s"]) for w in waves]
    recs = records(result)
    extra = result.get("extra") or {}
    wave_tokens = [sum(int(r["tokens"]) for r in w["requests"]) for w in waves]
    if kind in ("sweep", "long_prefill", "sustained", "nonstream"):
        out = basic(recs, sum(walls), walls, wave_tokens, streaming=kind != "nonstream")
        if kind == "sweep":
            out["concurrency"] = extra.get("concurrency")
        return out
    if kind == "shared_prefix":
        return _shared_prefix(recs, sum(walls), extra)
    if kind == "mixed":
        return _mixed(recs, sum(walls), extra, idle_long_ttft_s)
    if kind == "slow_readers":
        slow_ids = set(extra.get("slow_ids", []))
        fast = [r for r in recs if r.id not in slow_ids]
        slow = [r for r in recs if r.id in slow_ids]
        out = basic(fast, sum(walls))
        out["slow"] = basic(slow, sum(walls))
        return out
    if kind == "cancel":
        return _cancel(recs, sum(walls), extra)
    return basic(recs, sum(walls))


def _shared_prefix(recs: list[RequestRecord], wall: float, extra: dict[str, Any]) -> dict[str, Any]:
    out = basic(recs, wall)
    cold = [r for r in recs if r.id.endswith("/t0")]
    warm = [r for r in recs if not r.id.endswith("/t0")]
    cold_ttft, warm_ttft = percentile(_ttfts(cold), 50), percentile(_ttfts(warm), 50)
    out["cold_ttft_ms"] = summary_ms(_ttfts(cold))
    out["warm_ttft_ms"] = summary_ms(_ttfts(warm))
    out["speedup"] = ratio(cold_ttft, warm_ttft)
    out["cold_prompt_tokens"] = mean([r.prompt_tokens for r in cold if r.prompt_tokens])
    out["warm_prompt_tokens"] = mean([r.prompt_tokens for r in warm if r.prompt_tokens])
    out["warm_cached_tokens"] = mean([r.cached_tokens for r in warm if r.cached_tokens is not None])
    out["cold_cached_tokens"] = mean([r.cached_tokens for r in cold if r.cached_tokens is not None])
    b, a = extra.get("prefix_cache_before"), extra.get("prefix_cache_after")
    if isinstance(a, dict) and isinstance(b, dict):
        out["prefix_cache"] = {
            k: a.get(k, 0) - b.get(k, 0)
            for k in ("lookups", "hits", "reused_tokens", "inserts", "evictions")
        }
        out["prefix_cache"]["bytes_after"] = a.get("bytes")
    return out


def _mixed(
    recs: list[RequestRecord], wall: float, extra: dict[str, Any], idle_long_ttft_s: float | None
) -> dict[str, Any]:
    long_id = extra.get("long_id")
    streams = [r for r in recs if r.id != long_id]
    long = next((r for r in recs if r.id == long_id), None)
    out = basic(streams, wall)
    arrival = extra.get("arrival")
    if arrival is None or long is None:
        return out
    # Steady: once every stream has two tokens, until the long prompt arrives.
    starts = [r.events[1][0] for r in streams if len(r.events) > 1]
    steady_from = max(starts) if len(starts) == len(streams) else arrival
    steady, pressure, timeline = [], [], []
    long_first = long.first_token if long.first_token is not None else long.done or arrival
    for i, r in enumerate(streams):
        for (a, _), (b, _) in itertools.pairwise(r.events):
            timeline.append([round(b, 6), round(b - a, 6), i])
            if steady_from <= a and b <= arrival:
                steady.append(b - a)
    steady_p50 = percentile(steady, 50) or 0.0
    # Pressure: gaps that end after the arrival, up to just past the long prompt's
    # first token (the stall of its last prefill chunk included).
    until = long_first + 2 * steady_p50
    for r in streams:
        for (a, _), (b, _) in itertools.pairwise(r.events):
            if arrival < b <= until:
                pressure.append(b - a)
    long_ttft = (long.first_token - long.sent) if long.first_token is not None else None
    out.update(
        {
            "steady_itl_ms": summary_ms(steady),
            "pressure_itl_ms": summary_ms(pressure),
            "itl_p99_ratio": ratio(percentile(pressure, 99), percentile(steady, 99)),
            "long_ttft_ms": None if long_ttft is None else round(long_ttft * 1e3, 3),
            "idle_long_ttft_ms": None
            if idle_long_ttft_s is None
            else round(idle_long_ttft_s * 1e3, 3),
            "long_ttft_ratio": ratio(long_ttft, idle_long_ttft_s),
            "long_ok": long.ok,
            "arrival_s": arrival,
            "long_first_token_s": long.first_token,
            "streams_ready": extra.get("streams_ready"),
            "timeline": timeline,
        }
    )
    return out


def _cancel(recs: list[RequestRecord], wall: float, extra: dict[str, Any]) -> dict[str, Any]:
    bg = set(extra.get("background_ids", []))
    cancels = [r for r in recs if r.id not in bg]
    out = basic(cancels, wall)
    c2r = [r.cancel_to_retire_s for r in cancels if r.cancel_to_retire_s is not None]
    rtts = [r.cancel_poll_rtt_s for r in cancels if r.cancel_poll_rtt_s is not None]
    # The poll's answer left the worker after the abort was counted and still had to
    # travel back: take off half its round trip for an estimate (not a bound).
    est = [
        max(0.0, r.cancel_to_retire_s - r.cancel_poll_rtt_s / 2)
        for r in cancels
        if r.cancel_to_retire_s is not None and r.cancel_poll_rtt_s is not None
    ]
    server = [
        r.server_cancel_to_retire_s for r in cancels if r.server_cancel_to_retire_s is not None
    ]
    stages: dict[str, int] = {}
    for r in cancels:
        stages[r.cancel_stage or "not cancelled"] = (
            stages.get(r.cancel_stage or "not cancelled", 0) + 1
        )
    out.update(
        {
            "wanted_stage": extra.get("stage"),
            "stages": stages,
            "server_cancel_to_retire_ms": summary_ms(server),
            "cancel_to_retire_ms": summary_ms(c2r),
            "cancel_to_retire_est_ms": summary_ms(est),
            "poll_rtt_ms": summary_ms(rtts),
            "poll_rtt_idle_ms": None
            if extra.get("poll_rtt_idle_s") is None
            else round(extra["poll_rtt_idle_s"] * 1e3, 3),
            "decode_step_ms": None
            if extra.get("decode_step_s") is None
            else round(extra["decode_step_s"] * 1e3, 3),
            "gateway_cancel_to_retire": extra.get("gateway_cancel_to_retire")
            or extra.get("gateway_cancel_to_abort"),
            "gateway_cancel_stages": extra.get("gateway_cancel_stages"),
            "background": basic([r for r in recs if r.id in bg], wall),
        }
    )
    return out


def summarize_target(name: str, data: dict[str, Any]) -> dict[str, Any]:
    scen = data.get("scenarios") or {}
    idle = None
    if "long_prefill" in scen:
        ttfts = _ttfts(records(scen["long_prefill"]))
        idle = percentile(ttfts, 50)
    return {s: summarize_scenario(s, r, idle) for s, r in scen.items()}


# -- across targets ---------------------------------------------------------------


def best_ceiling(summary: dict[str, dict[str, Any]]) -> dict[str, str]:
    """With both ceilings measured, make summary["ceiling"] the faster one per
    scenario (output tok/s), keeping MLX's defaults as "ceiling_defaults".
    Returns which one each scenario uses ({} with MLX's defaults alone).
    With `ceiling_alt` alone (`--targets ceiling_alt,...`), it is the ceiling."""
    base, alt = summary.get("ceiling"), summary.get("ceiling_alt")
    if not alt:
        return {}
    if not base:
        summary["ceiling"] = alt
        return {scen: "ceiling_alt" for scen in sorted(alt)}
    summary["ceiling_defaults"] = base
    best, choice = {}, {}
    for scen in {*base, *alt}:
        a, b = base.get(scen), alt.get(scen)
        pick = (
            "ceiling_alt"
            if b and (not a or (b.get("tok_s") or 0) > (a.get("tok_s") or 0))
            else "ceiling"
        )
        best[scen] = b if pick == "ceiling_alt" else a
        choice[scen] = pick
    summary["ceiling"] = best
    return dict(sorted(choice.items()))


def ratios(summary: dict[str, dict[str, Any]], paired: bool = False) -> list[dict[str, Any]]:
    """Per scenario, for the metrics they share: every target's value and the ratios.

    Rows follow mlxd's scenarios (then any only the engine ran, when mlxd did
    not). Keys: mlxd/ceiling and mlxd/peer as before, plus engine/ceiling
    (the worker's core over the raw BatchGenerator) and mlxd/engine (the serving
    path over the worker's core). A missing target gives None. `paired`: the
    run interleaved its targets (paired_run), so tok/s spreads pair waves.
    """
    rows = []
    mlxd = summary.get("mlxd") or {}
    engine = summary.get("engine") or {}
    scenarios = list(mlxd) + [s for s in engine if s not in mlxd]
    for scen in scenarios:
        if scen.startswith("cancel"):
            continue  # clients leave on purpose: their rates compare nothing
        m = mlxd.get(scen) or {}
        e = engine.get(scen) or {}
        ceil = (summary.get("ceiling") or {}).get(scen) or {}
        peer = (summary.get("peer") or {}).get(scen) or {}
        lead = m or e  # which metrics exist: mlxd's, else the engine's

        metrics = [("tok_s", "output tok/s", True)]
        if lead.get("ttft_ms", {}).get("n"):
            metrics.append(("ttft_p50", "TTFT p50 (ms)", False))
        if lead.get("itl_ms", {}).get("n"):
            metrics.append(("itl_p50", "ITL p50 (ms)", False))
        if lead.get("e2e_ms", {}).get("n") and scen == "nonstream":
            metrics.append(("e2e_p50", "E2E p50 (ms)", False))
        for key, label, higher_better in metrics:
            a, c, p = _metric(m, key), _metric(ceil, key), _metric(peer, key)
            en = _metric(e, key)
            rows.append(
                {
                    "scenario": scen,
                    "metric": label,
                    "higher_is_better": higher_better,
                    "mlxd": a,
                    "ceiling": c,
                    "peer": p,
                    "mlxd_over_ceiling": ratio(a, c),
                    "mlxd_over_peer": ratio(a, p),
                    "engine": en,
                    "engine_over_ceiling": ratio(en, c),
                    "mlxd_over_engine": ratio(a, en),
                    # tok/s only: each ratio's relative 95% half-width over waves
                    "spread": {
                        "engine_over_ceiling": ratio_spread(e, ceil, paired),
                        "mlxd_over_ceiling": ratio_spread(m, ceil, paired),
                        "mlxd_over_engine": ratio_spread(m, e, paired),
                    }
                    if key == "tok_s"
                    else None,
                }
            )
    return rows


def _metric(m: dict[str, Any], key: str) -> float | None:
    if not m:
        return None
    if key == "tok_s":
        v = m.get("tok_s")
        return None if v is None else float(v)
    base, q = key.split("_")
    d = m.get(f"{base}_ms") or {}
    v = d.get(q)
    return None if v is None else float(v)


def parity(results: dict[str, Any]) -> dict[str, Any]:
    """Greedy outputs that should agree: mlxd and the engine vs the ceiling (token
    ids), mlxd vs the peer (text)."""
    targets = results.get("targets") or {}

    def by_id(name: str) -> dict[str, RequestRecord]:
        out: dict[str, RequestRecord] = {}
        for res in ((targets.get(name) or {}).get("scenarios") or {}).values():
            for r in records(res):
                if r.ok and r.cancelled_at is None:
                    out[r.id] = r
        return out

    mlxd, ceil, peer = by_id("mlxd"), by_id("ceiling"), by_id("peer")
    out: dict[str, Any] = {}
    for name, recs in (("mlxd", mlxd), ("engine", by_id("engine"))):
        pairs = [
            (i, recs[i], ceil[i])
            for i in sorted(recs.keys() & ceil.keys())
            if recs[i].token_ids is not None and ceil[i].token_ids is not None
        ]
        if pairs:
            same = [i for i, a, b in pairs if a.token_ids == b.token_ids]
            out[f"{name}_vs_ceiling_token_ids"] = {
                "compared": len(pairs),
                "identical": len(same),
                "first_mismatches": [i for i, a, b in pairs if a.token_ids != b.token_ids][:5],
            }
    tpairs = [
        (i, mlxd[i], peer[i])
        for i in sorted(mlxd.keys() & peer.keys())
        if not i.startswith("shared_prefix")
    ]  # later turns depend on earlier text
    specials = [t for t in (results.get("model") or {}).get("special_tokens", []) if t]

    def plain(text: str) -> str:
        # mlxd never renders special tokens as text; mlx_lm.server does.
        for t in specials:
            text = text.replace(t, "")
        return text

    if tpairs:
        diff = [i for i, a, b in tpairs if plain(a.text) != plain(b.text)]
        out["mlxd_vs_peer_text"] = {
            "compared": len(tpairs),
            "identical": len(tpairs) - len(diff),
            "first_mismatches": diff[:5],
        }
    return out


def checks(results: dict[str, Any], summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue #6's targets, each with the measured value and pass/fail (None: not measured)."""
    out: list[dict[str, Any]] = []
    mlxd = summary.get("mlxd") or {}
    ceil = summary.get("ceiling") or {}

    for scen, m in sorted(mlxd.items(), key=lambda kv: kv[1].get("concurrency") or 0):
        c = m.get("concurrency")
        if c is None:
            continue
        r = ratio(m.get("tok_s"), (ceil.get(scen) or {}).get("tok_s"))
        named = c in OVERHEAD_LEVELS
        out.append(
            _check(
                f"overhead C={c}" + ("" if named else " (extra level)"),
                r,
                f">= {OVERHEAD_MIN}",
                None if r is None else r >= OVERHEAD_MIN,
                "mlxd aggregate tok/s / ceiling tok/s",
            )
        )

    mixed = mlxd.get("mixed_pressure") or {}
    r = mixed.get("itl_p99_ratio")
    out.append(
        _check(
            "mixed pressure: streams' p99 ITL",
            r,
            f"<= {MIXED_ITL_MAX}x steady",
            None if r is None else r <= MIXED_ITL_MAX,
            f"steady p99 {mixed.get('steady_itl_ms', {}).get('p99')} ms, during "
            f"prefill p99 {mixed.get('pressure_itl_ms', {}).get('p99')} ms",
        )
    )
    r = mixed.get("long_ttft_ratio")
    out.append(
        _check(
            "mixed pressure: long prompt TTFT",
            r,
            f"<= {MIXED_TTFT_MAX}x idle",
            None if r is None else r <= MIXED_TTFT_MAX,
            f"{mixed.get('long_ttft_ms')} ms vs idle {mixed.get('idle_long_ttft_ms')} ms",
        )
    )

    for scen in ("cancel_prefill", "cancel_decode"):
        m = mlxd.get(scen) or {}
        server = (m.get("server_cancel_to_retire_ms") or {}).get("p99")
        bound = (m.get("cancel_to_retire_ms") or {}).get("p99")
        est = (m.get("cancel_to_retire_est_ms") or {}).get("p99")
        value = server if server is not None else est
        step = m.get("decode_step_ms")
        limit = None if step is None else step + CANCEL_SLACK_S * 1e3
        ok = None if value is None or limit is None else value <= limit
        source = (
            "mlxd's own measure (gateway: client gone -> the worker's terminal output)"
            if server is not None
            else "estimate from polling the worker's stats"
        )
        out.append(
            _check(
                f"{scen}: cancellation-to-retirement p99",
                value,
                "<= decode step + 5 ms" + ("" if limit is None else f" = {limit:.2f} ms"),
                ok,
                f"{source}; client-side: polled upper bound {_fmt(bound, 2)} ms, less half the "
                f"poll's round trip {_fmt(est, 2)} ms; client-side stages {m.get('stages')}, "
                f"gateway stages {m.get('gateway_cancel_stages')}",
                unit="ms",
            )
        )

    sp = mlxd.get("shared_prefix") or {}
    r = sp.get("speedup")
    hist = (results.get("workload") or {}).get("preset", {}).get("prefix_history_tokens")
    out.append(
        _check(
            "shared prefix: cold / warm TTFT",
            r,
            f">= {PREFIX_SPEEDUP_MIN}x",
            None if r is None else r >= PREFIX_SPEEDUP_MIN,
            f"history {hist} tokens; warm turns reused "
            f"{_fmt(sp.get('warm_cached_tokens'))} cached tokens on average",
        )
    )

    mem = ((results.get("targets") or {}).get("mlxd") or {}).get("memory") or {}
    live_ok, drift_ok, note = memory_at_rest(mem)
    out.append(
        _check(
            "memory: live state back to resting",
            None,
            "live state 0, no reserved growth or reservations, no request",
            live_ok,
            note,
        )
    )
    out.append(
        _check(
            "memory: active memory back to resting",
            None,
            "active memory less the prefix cache's buffers at most 1 MiB above before",
            drift_ok,
            note + " (the prefix cache is meant to grow; anything "
            "else that stays is memory the worker keeps after the load)",
        )
    )
    return out


def memory_at_rest(mem: dict[str, Any]) -> tuple[bool | None, bool | None, str]:
    """(live state at rest, active memory at rest, note) from the before/after snapshots."""
    before, after = mem.get("before") or {}, mem.get("after") or {}
    gb, ga = before.get("governor"), after.get("governor")
    if not isinstance(gb, dict) or not isinstance(ga, dict):
        return None, None, "no worker stats"
    live = (
        ga.get("live_state", 0) == 0
        and ga.get("reserved_growth", 0) == 0
        and ga.get("reserved_requests", 0) == 0
        and not after.get("requests")
    )
    mb, ma = before.get("memory") or {}, after.get("memory") or {}
    pb, pa = _prefix_allocated(before), _prefix_allocated(after)
    drift = (ma.get("active_bytes", 0) - pa) - (mb.get("active_bytes", 0) - pb)
    note = (
        f"live_state {ga.get('live_state')} B, reserved_growth {ga.get('reserved_growth')} B, "
        f"reserved requests {ga.get('reserved_requests')}; active less prefix cache drift "
        f"{drift:+d} B; prefix cache {pb} -> {pa} B"
    )
    # One-sided: memory the worker gave back (the H200 showed -12 to -15 MB,
    # warm-up buffers and allocator rounding of the prefix cache's entries)
    # is not memory it keeps.
    return live, drift <= MEMORY_TOLERANCE_BYTES, note


def _prefix_allocated(snapshot: dict[str, Any]) -> int:
    """What the prefix cache's entries take in MLX's allocator: their
    buffers (`allocated_bytes`, page-rounded: worker/backend.py), where the
    worker reports them, else their contents (`bytes`, results of earlier
    runs). Their rounding is not memory the worker keeps: on the H200 it
    was 0.36 MB an entry on the 0.5B shape (session 28), about half of the
    50.3 MB session 26's H100 sweep failed the check by."""
    prefix = snapshot.get("prefix_cache") or {}
    return int(prefix.get("allocated_bytes", prefix.get("bytes", 0)))


def _check(
    name: str, value: float | None, limit: str, ok: bool | None, note: str, unit: str = ""
) -> dict[str, Any]:
    return {"check": name, "value": value, "unit": unit, "limit": limit, "pass": ok, "note": note}


def _fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"
