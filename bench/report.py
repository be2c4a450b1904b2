"""The Markdown report of one run (results JSON in, text out).

Owns presentation only: the numbers come from bench/analysis.py and are
stored in the results file's "summary", "ratios", "checks" and "parity".
"""

from __future__ import annotations

from typing import Any

from bench.analysis import TARGETS, paired_run, wave_seconds, waves_for
from bench.steps import steps_table


def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _pct(d: dict[str, Any] | None) -> str:
    if not d or not d.get("n"):
        return "-"
    return f"{_f(d.get('p50'))} / {_f(d.get('p95'))} / {_f(d.get('p99'))}"


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("PASS" if ok else "FAIL")


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def markdown(results: dict[str, Any]) -> str:
    w = results["workload"]
    model = results["model"]
    lines: list[str] = []
    add = lines.append
    add(f"# mlxd benchmark: `{w['preset']['name']}` preset")
    add("")
    add(f"- Date: {results['created']}; command: `{results['command']}`")
    add(
        f"- Model: `{model['path']}` (identity `{model['identity']}`"
        + (f", random-weight shape `{model['shape']}`" if model.get("shape") else "")
        + f"), config {model['config']}"
    )
    add(
        f"- Workload: digest `{w['digest']}`, seed {w['seed']}, EOS suppressed: "
        f"{w['suppress_eos'] or 'no'}"
    )
    add(
        "- Order: interleaved (every target at once; each wave of the sweep, long-prefill "
        "and sustained scenarios on all of them back to back, the order rotated per wave)"
        if paired_run(results)
        else "- Order: one target after another"
    )
    share = (results.get("interleave") or {}).get("memory_share_bytes")
    if share:
        add(
            f"- GPU memory per target: {_bytes(share)} (every target alive at once; MLX's "
            "memory limit in each, mlxd's and the engine's memory budget)"
        )
    cut = (results.get("interleave") or {}).get("cut")
    if cut:
        add(f"- Cut short by the run's deadline (`--deadline-s`): {', '.join(cut)}")
    m = results["machine"]
    add(
        f"- Machine: {m.get('cpu_model')} ({m.get('cpu_count')} CPUs, "
        f"{_bytes(m.get('memory_bytes'))}), {m.get('platform')}"
        + (f", GPUs: {'; '.join(m['gpus'])}" if m.get("gpus") else "")
    )
    add(f"- Backend: {results.get('backend')}, BLAS: {results.get('blas')}")
    v = results["versions"]
    add("- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    for name in TARGETS:
        t = (results.get("targets") or {}).get(name)
        if t is None:
            add(f"- {name}: not run ({(results.get('skipped') or {}).get(name, 'not selected')})")
        elif t.get("server"):
            add(
                f"- {name}: started in {_f(t['server'].get('startup_s'))} s: "
                f"`{' '.join(t['server'].get('argv') or []) or t['server'].get('url')}`"
            )
        elif name == "ceiling":
            add(
                f"- ceiling: BatchGenerator in-process, load {_f(t.get('load_s'))} s, "
                f"MLX_USE_CUDA_GRAPHS {t.get('cuda_graphs_env')}"
            )
        elif name == "engine":
            e = t.get("engine") or {}
            add(
                f"- engine: mlxd's EngineCore over Runner in-process, load "
                f"{_f(t.get('load_s'))} s, warm-up {_f(t.get('warmup_s'))} s; pacing "
                f"{_f(e.get('pacing'))}, prefix cache {_bytes(e.get('prefix_cache_bytes'))}, "
                f"memory budget {_bytes(e.get('memory_budget_bytes'))}"
            )
    alt = (results.get("targets") or {}).get("ceiling_alt")
    if alt is not None:
        add(
            f"- ceiling_alt: the ceiling at mlxd's CUDA settings (graphs and cuDNN "
            f"attention off), load {_f(alt.get('load_s'))} s; every ratio uses the faster "
            "ceiling per scenario (below)"
        )
    add("")

    add("## Issue #6 targets")
    add("")
    add("| check | measured | target | verdict | note |")
    add("|---|---|---|---|---|")
    for c in results.get("checks") or []:
        add(
            f"| {c['check']} | {_f(c['value'], 3)}{(' ' + c['unit']) if c['unit'] else ''} | "
            f"{c['limit']} | {_verdict(c['pass'])} | {c['note']} |"
        )
    add("")

    add("## mlxd against the ceiling, its own engine and the peer (mlx_lm.server)")
    add("")
    add(
        "Ceiling: mlx-lm's BatchGenerator in-process. Engine: mlxd's worker core "
        "(EngineCore over Runner) in-process, no IPC or HTTP. So engine/ceiling is what "
        "the worker's scheduling, sampling and bookkeeping cost, mlxd/engine what the "
        "serving path costs (IPC, gateway, HTTP, and the load generator on the same "
        "machine), and mlxd/ceiling both. Each ratio is the first target's value over "
        "the second's: above 1 is better for tok/s, worse for latencies."
    )
    add("")
    add(
        "| scenario | metric | ceiling | engine | mlxd | peer | engine/ceiling | "
        "mlxd/engine | mlxd/ceiling | mlxd/peer |"
    )
    add("|---|---|---|---|---|---|---|---|---|---|")
    for r in results.get("ratios") or []:
        # .get: results written before the engine target have no engine keys.
        add(
            f"| {r['scenario']} | {r['metric']} | {_f(r['ceiling'])} | {_f(r.get('engine'))} | "
            f"{_f(r['mlxd'])} | {_f(r['peer'])} | {_f(r.get('engine_over_ceiling'), 3)} | "
            f"{_f(r.get('mlxd_over_engine'), 3)} | {_f(r['mlxd_over_ceiling'], 3)} | "
            f"{_f(r['mlxd_over_peer'], 3)} |"
        )
    add("")

    _spread_section(add, results)
    summary = results.get("summary") or {}
    add("## Every scenario")
    add("")
    add("Latencies in ms as p50 / p95 / p99. ITL: gap between token events.")
    add("")
    add("| scenario | target | requests | errors | TTFT | ITL | E2E | tok/s | req/s |")
    add("|---|---|---|---|---|---|---|---|---|")
    scen_names = list((summary.get("mlxd") or summary.get("peer") or {}).keys())
    for name in ("engine", "ceiling"):
        for extra in summary.get(name) or {}:
            if extra not in scen_names:
                scen_names.append(extra)
    for s in scen_names:
        for t in TARGETS:
            # "ceiling" rows are that run's own (the ratios' best-of aside)
            source = "ceiling_defaults" if t == "ceiling" and "ceiling_defaults" in summary else t
            d = (summary.get(source) or {}).get(s)
            if not d:
                continue
            add(
                f"| {s} | {t} | {d['requests']} | {d['errors']} | {_pct(d.get('ttft_ms'))} | "
                f"{_pct(d.get('itl_ms'))} | {_pct(d.get('e2e_ms'))} | {_f(d.get('tok_s'))} | "
                f"{_f(d.get('req_s'), 3)} |"
            )
    add("")

    _cpu_section(add, summary)
    _ceilings_section(add, results)
    _mixed_section(add, summary)
    _mixed_steps_section(add, results)
    _prefix_section(add, summary)
    _cancel_section(add, summary)
    _slow_section(add, summary)
    _memory_section(add, results)
    _errors_section(add, summary)

    add("## Token parity (greedy)")
    add("")
    par = results.get("parity") or {}
    if not par:
        add("Nothing to compare (a single target).")
    for key, p in par.items():
        add(
            f"- {key.replace('_', ' ')}: {p['identical']}/{p['compared']} identical"
            + (
                f"; first mismatches: {', '.join(p['first_mismatches'])}"
                if p["first_mismatches"]
                else ""
            )
        )
    add("")

    add("## Plots")
    add("")
    plots = results.get("plots") or {}
    if plots.get("files"):
        for f in plots["files"]:
            add(f"![{f}]({f})")
    else:
        add(f"No plots: {plots.get('note', 'not written')}.")
    add("")
    return "\n".join(lines)


def _cpu_section(add: Any, summary: dict[str, Any]) -> None:
    mlxd, peer = summary.get("mlxd") or {}, summary.get("peer") or {}
    names = [*mlxd, *(s for s in peer if s not in mlxd)]
    rows = []
    for s in names:
        m = (mlxd.get(s) or {}).get("cpu_us_per_token") or {}
        p = (peer.get(s) or {}).get("cpu_us_per_token") or {}
        if m or p:
            total = m["gateway"] + m["worker"] if "gateway" in m and "worker" in m else None
            rows.append(
                f"| {s} | {_f(m.get('gateway'), 1)} | {_f(m.get('worker'), 1)} | "
                f"{_f(total, 1)} | {_f(p.get('server'), 1)} |"
            )
    if not rows:
        return
    add("## CPU per output token")
    add("")
    add(
        "Microseconds of CPU (user + system, from /proc) each process spent over the "
        "scenario per output token: mlxd's gateway and worker apart, the peer's one "
        "process. The gateway's share is the serving path's own work (HTTP, SSE, "
        "detokenizing, IPC); the worker's holds the model's steps (on a GPU, whatever its "
        "waits for the device cost the CPU). In an interleaved run a scenario's span "
        "also holds the other targets' waves, while this one idles."
    )
    add("")
    add("| scenario | mlxd gateway | mlxd worker | mlxd total | peer |")
    add("|---|---|---|---|---|")
    for row in rows:
        add(row)
    add("")


def _mixed_section(add: Any, summary: dict[str, Any]) -> None:
    add("## Mixed prefill/decode pressure")
    add("")
    add(
        "Streams decode; once each has its steady tokens, a long prompt arrives. Gaps of "
        "the streams before (steady) and from its arrival to just past its first token "
        "(pressure)."
    )
    add("")
    add(
        "| target | steady ITL | pressure ITL | p99 ratio | long TTFT (ms) | idle TTFT (ms) "
        "| TTFT ratio |"
    )
    add("|---|---|---|---|---|---|---|")
    for t in ("mlxd", "peer"):
        d = (summary.get(t) or {}).get("mixed_pressure")
        if d:
            add(
                f"| {t} | {_pct(d.get('steady_itl_ms'))} | {_pct(d.get('pressure_itl_ms'))} | "
                f"{_f(d.get('itl_p99_ratio'))} | {_f(d.get('long_ttft_ms'))} | "
                f"{_f(d.get('idle_long_ttft_ms'))} | {_f(d.get('long_ttft_ratio'))} |"
            )
    add("")


def _mixed_steps_section(add: Any, results: dict[str, Any]) -> None:
    rows = (results.get("mlxd_steps") or {}).get("mixed_pressure") or []
    if not rows:
        return
    add("### mlxd's steps under mixed pressure")
    add("")
    add(
        "From the worker's step trace (`--step-trace`, bench/steps.py): each engine step "
        "from the long prompt's arrival to just past its first token. Period: since the "
        "step before ended (what a stream waited); step: `Runner.step`'s own time; "
        "predicted: the cost model's estimate when the step was planned."
    )
    add("")
    for line in steps_table(rows):
        add(line)
    add("")


def _prefix_section(add: Any, summary: dict[str, Any]) -> None:
    add("## Shared-prefix reuse (multi-turn chat)")
    add("")
    add(
        "| target | cold TTFT (turn 1) | warm TTFT (later turns) | speedup | warm prompt / "
        "cached tokens | prefix cache (mlxd worker) |"
    )
    add("|---|---|---|---|---|---|")
    for t in ("mlxd", "peer"):
        d = (summary.get(t) or {}).get("shared_prefix")
        if d:
            add(
                f"| {t} | {_pct(d.get('cold_ttft_ms'))} | {_pct(d.get('warm_ttft_ms'))} | "
                f"{_f(d.get('speedup'))} | {_f(d.get('warm_prompt_tokens'), 0)} / "
                f"{_f(d.get('warm_cached_tokens'), 0)} | {d.get('prefix_cache', '-')} |"
            )
    add("")


def _cancel_section(add: Any, summary: dict[str, Any]) -> None:
    add("## Cancellations")
    add("")
    add(
        "Cancellations happen one at a time while background streams decode. mlxd's own "
        "measure: its gateway times each from noticing the client left to the worker's "
        "terminal output for the request (its `mlxd_cancel_to_retire_seconds` histogram, "
        "read around each cancellation). Client-side: from closing the connection to the "
        "first worker stats answer that counts the abort (an upper bound that includes the "
        "poll's own round trip), and that less half the round trip."
    )
    add("")
    add(
        "| scenario | target | client stages | gateway stages | mlxd cancel->retire (ms) | "
        "polled bound (ms) | estimate (ms) | poll RTT p50 | decode step (ms) |"
    )
    add("|---|---|---|---|---|---|---|---|---|")
    for s in ("cancel_prefill", "cancel_decode"):
        for t in ("mlxd", "peer"):
            d = (summary.get(t) or {}).get(s)
            if not d:
                continue
            add(
                f"| {s} | {t} | {d.get('stages')} | {d.get('gateway_cancel_stages') or '-'} | "
                f"{_pct(d.get('server_cancel_to_retire_ms'))} | "
                f"{_pct(d.get('cancel_to_retire_ms'))} | "
                f"{_pct(d.get('cancel_to_retire_est_ms'))} | "
                f"{_f((d.get('poll_rtt_ms') or {}).get('p50'))} | {_f(d.get('decode_step_ms'))} |"
            )
    add("")


def _slow_section(add: Any, summary: dict[str, Any]) -> None:
    add("## Slow readers")
    add("")
    add(
        "| target | normal streams ITL | normal errors | slow readers ITL | slow errors "
        "| slow tokens |"
    )
    add("|---|---|---|---|---|---|")
    for t in ("mlxd", "peer"):
        d = (summary.get(t) or {}).get("slow_readers")
        if d:
            slow = d.get("slow") or {}
            add(
                f"| {t} | {_pct(d.get('itl_ms'))} | {d.get('errors')} | "
                f"{_pct(slow.get('itl_ms'))} | {slow.get('errors')} | "
                f"{slow.get('output_tokens')} |"
            )
    add("")


def _memory_section(add: Any, results: dict[str, Any]) -> None:
    add("## Memory at rest")
    add("")
    add(
        "| target | when | live state | reserved growth | prefix cache | active | MLX cache | RSS |"
    )
    add("|---|---|---|---|---|---|---|---|")
    for t in ("mlxd", "peer"):
        mem = ((results.get("targets") or {}).get(t) or {}).get("memory") or {}
        for when in ("before", "after"):
            s = mem.get(when)
            if not s:
                continue
            g = s.get("governor") or {}
            mm = s.get("memory") or {}
            rss = ", ".join(f"{k} {_bytes(v)}" for k, v in (s.get("rss") or {}).items() if v)
            add(
                f"| {t} | {when} | {_bytes(g.get('live_state'))} | "
                f"{_bytes(g.get('reserved_growth'))} | {_bytes(g.get('prefix_cache'))} | "
                f"{_bytes(mm.get('active_bytes'))} | {_bytes(mm.get('cache_bytes'))} | "
                f"{rss or '-'} |"
            )
    add("")


def _errors_section(add: Any, summary: dict[str, Any]) -> None:
    samples = [
        (t, s, e)
        for t, scen in summary.items()
        for s, d in scen.items()
        for e in d.get("error_samples", [])
    ]
    add("## Errors")
    add("")
    if not samples:
        add("None.")
    for t, s, e in samples[:20]:
        add(f"- {t} {s}: {e}")
    add("")


def _spread_section(add: Any, results: dict[str, Any]) -> None:
    """Each sweep level's tok/s ratios with their wave-to-wave spread."""
    rows = [
        r
        for r in results.get("ratios") or []
        if r.get("spread") and r["scenario"].startswith("sweep")
    ]
    if not rows:
        return
    summary = results.get("summary") or {}
    lead = summary.get("mlxd") or summary.get("engine") or {}  # whose waves to count
    add("## Throughput ratios with their spread")
    add("")
    if paired_run(results):
        add(
            "Each tok/s ratio with the 95% half-width of its per-wave ratios (relative; "
            "this run interleaved its targets, so wave i of each ran seconds apart and "
            "the pairs share the machine's state): how far one run's ratio may sit "
            "from the level's true ratio. More waves narrow it."
        )
    else:
        add(
            "Each tok/s ratio with the 95% half-width of its wave-to-wave variation "
            "(relative, the two targets' spreads in quadrature): how far one run's ratio "
            "may sit from the level's true ratio. More waves narrow it. The targets ran "
            "one after another: drift of the machine between them is not in it "
            "(`--interleave` pairs them)."
        )
    add("")
    add(
        f"Waves for ±{SPREAD_GOAL}: how many waves the wider of engine/ceiling and "
        "mlxd/ceiling would need for a half-width of that much (it falls as one over "
        "the square root of the waves); the seconds are those waves on every target of "
        "this run, at this run's seconds per wave."
    )
    add("")
    add(
        "| scenario | waves | engine/ceiling | mlxd/ceiling | mlxd/engine "
        f"| waves for ±{SPREAD_GOAL} | seconds |"
    )
    add("|---|---|---|---|---|---|---|")
    per_wave = wave_seconds(results)
    total = 0.0
    for r in rows:
        scen = r["scenario"]
        waves = len((lead.get(scen) or {}).get("wave_tok_s", []))
        cells = [
            _pm(r.get(k), r["spread"].get(k))
            for k in ("engine_over_ceiling", "mlxd_over_ceiling", "mlxd_over_engine")
        ]
        need = [
            waves_for(r["spread"].get(k), waves, SPREAD_GOAL)
            for k in ("engine_over_ceiling", "mlxd_over_ceiling")
        ]
        most = max((n for n in need if n is not None), default=None)
        seconds = most * per_wave[scen] if most is not None and scen in per_wave else None
        total += seconds or 0.0
        cells += [_f(most), _f(seconds, 0)]
        add(f"| {scen} | {waves or '-'} | " + " | ".join(cells) + " |")
    if total:
        add(f"| all levels | | | | | | {total:.0f} |")
    add("")


# The bound on a throughput ratio's spread (#12).
SPREAD_GOAL = 0.03


def _pm(value: float | None, rel: float | None) -> str:
    """ "0.953 ± 0.021" (the half-width in the ratio's own units), or the value alone."""
    if value is None:
        return "-"
    if rel is None:
        return f"{value:.3f}"
    return f"{value:.3f} ± {value * rel:.3f}"


def _ceilings_section(add: Any, results: dict[str, Any]) -> None:
    """Both ceilings' throughput per scenario, and which one the ratios use."""
    choice = results.get("ceiling_choice") or {}
    summary = results.get("summary") or {}
    base, alt = summary.get("ceiling_defaults") or {}, summary.get("ceiling_alt") or {}
    if not choice:
        return
    add("## The ceiling at both settings")
    add("")
    add(
        "mlx-lm's BatchGenerator at MLX's defaults (`ceiling`: on CUDA, graphs and cuDNN "
        "attention on) and at mlxd's CUDA settings (`ceiling_alt`: both off). Every ratio "
        "above uses the faster one per scenario. On the CPU and Metal the two are the same "
        "code: their difference is run-to-run spread."
    )
    add("")
    add("| scenario | ceiling tok/s | ceiling_alt tok/s | used |")
    add("|---|---|---|---|")
    for scen, pick in choice.items():
        a, b = (base.get(scen) or {}).get("tok_s"), (alt.get(scen) or {}).get("tok_s")
        add(f"| {scen} | {_f(a)} | {_f(b)} | {pick} |")
    add("")
