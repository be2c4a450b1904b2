"""`bench trace`: one traced run of mlxd, as Chrome trace JSON plus a summary.

Owns a diagnostic run, never a measured one (tracing costs time, so `bench run`
keeps it off): it replays a few scenarios (default: the concurrency sweep and
mixed pressure) against mlxd and writes
- `trace.json`: Chrome trace event format (chrome://tracing, ui.perfetto.dev).
  Process "bench client": one lane per concurrent request, with spans for the
  wait for the response, time to first token and decode, and an instant event
  per token event. Process "mlxd gateway": the gateway's own request trace
  (`serve --trace-file`), when the benchmark started the server, shifted onto
  the client's clock by matching request ids (both sides use CLOCK_MONOTONIC;
  the gateway's trace origin is recovered from the earliest possible arrival);
- `trace.md`: where the time goes, per scenario: client-side stages, and with
  the gateway trace the split of TTFT into network, tokenize, queue, worker
  (prefill and first step) and delivery, plus the decode gap against the
  worker's own decode step time.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import models, servers, steps
from bench.client import RequestRecord
from bench.progress import Progress
from bench.run import RunConfig, default_out, mlxd_target, prepare_workload, resolve_model
from bench.scenarios import TargetRunner
from bench.stats import mean, percentile

# First tokens of one worker step reach the gateway in one frame, microseconds
# apart; a wave split over two steps has its first tokens a whole step apart.
ONE_FRAME_S = 0.001
# TTFT split into the stages between the client's send and its first token.
TTFT_PARTS = ("network", "tokenize", "queue", "submit", "worker", "delivery", "ttft")

CLIENT_PID = 2
GATEWAY_PID = 1
WORKER_PID = 3


@dataclass(slots=True)
class TraceConfig:
    preset: str = "smoke"
    model: Path | None = None
    shape: str | None = None
    url: str | None = None
    out: Path | None = None
    seed: int = 0
    quiet: bool = False
    scenarios: tuple[str, ...] = ("sweep", "mixed_pressure")
    argv: list[str] = field(default_factory=list)
    mlxd_env: dict[str, str] = field(default_factory=dict)  # as `bench run --mlxd-env`


def trace(cfg: TraceConfig) -> int:
    run_cfg = RunConfig(
        preset=cfg.preset, model=cfg.model, shape=cfg.shape, url=cfg.url, seed=cfg.seed
    )
    model_dir, _ = resolve_model(run_cfg)
    out = (cfg.out or default_out(cfg.preset + "-trace")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wl = prepare_workload(run_cfg, model_dir).select(cfg.scenarios)
    progress = Progress(len(wl.scenarios) + 1, enabled=not cfg.quiet)
    gw_trace = out / "gateway-trace.json"
    progress.begin("mlxd: starting", 1)
    server = (
        servers.attach_mlxd(cfg.url)
        if cfg.url
        else servers.start_mlxd(
            model_dir,
            out,
            max_batch=wl.max_concurrency(),
            trace_file=gw_trace,
            env_extra={steps.STEP_TRACE_ENV: str(out / steps.STEPS_DIR), **cfg.mlxd_env},
        )
    )
    progress.end()
    target = mlxd_target(server.url, server.model, wl)
    runner = TargetRunner(target, server, wl, progress)
    try:
        data = asyncio.run(runner.run())
    finally:
        servers.stop(server)  # a clean stop closes the gateway's trace file
    gateway = _load_gateway_trace(gw_trace) if server.proc is not None else []
    worker = steps.load_steps(out / steps.STEPS_DIR) if server.proc is not None else []
    events, stages = build_trace(data, gateway, worker)
    (out / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    mixed = steps.mixed_pressure_steps({"targets": {"mlxd": data}}, worker)
    (out / "trace.md").write_text(summary_markdown(data, stages, model_dir, cfg, mixed))
    # The scenarios' own results (latencies, cancellations, prefix-cache turns), as
    # `bench run` records them; traced, so for reading rather than comparing.
    (out / "scenarios.json").write_text(json.dumps(data, default=str))
    progress.note(
        f"bench trace: wrote {out / 'trace.json'} (open in ui.perfetto.dev) and {out / 'trace.md'}"
    )
    return 0


def _load_gateway_trace(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text().strip()
    except OSError:
        return []
    if not text:
        return []
    if not text.endswith("]"):  # a killed gateway leaves the array open
        text = text.rstrip(",\n") + "\n]"
    try:
        events = json.loads(text)
    except ValueError:
        return []
    return [e for e in events if isinstance(e, dict)]


def _scenario_offsets(data: dict[str, Any]) -> dict[str, float]:
    """Each scenario's start on the trace axis (seconds after the first scenario began)."""
    scen = data.get("scenarios") or {}
    starts = {name: float(res.get("t0", 0.0)) for name, res in scen.items()}
    origin = min(starts.values(), default=0.0)
    return {name: t - origin for name, t in starts.items()}


def build_trace(
    data: dict[str, Any],
    gateway: list[dict[str, Any]],
    worker: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Chrome trace events, and per request id the gateway's stage times (trace axis, s).

    `worker`: the worker's step trace (bench/steps.py), one span per step on the
    client's axis (both clocks are CLOCK_MONOTONIC; the axis starts at the first
    scenario's t0)."""
    events: list[dict[str, Any]] = [_process_name(CLIENT_PID, "bench client")]
    lanes: list[float] = []
    sent_abs: dict[str, float] = {}
    offsets = _scenario_offsets(data)
    for name, res in (data.get("scenarios") or {}).items():
        shift = offsets[name]
        recs = [RequestRecord.from_json(r) for w in res["waves"] for r in w["requests"]]
        for r in sorted(recs, key=lambda x: x.sent):
            start, end = r.sent + shift, (r.done or r.sent) + shift
            tid = _lane(lanes, start, end)
            sent_abs[_rid(r.id)] = start
            args = {
                "id": r.id,
                "tokens": r.tokens,
                "ok": r.ok,
                "error": r.error,
                "cancel_stage": r.cancel_stage,
            }
            events.append(_span(name, start, end, tid, args))
            if r.first_byte is not None:
                events.append(_span("wait for response", start, r.first_byte + shift, tid, {}))
            if r.first_token is not None:
                events.append(_span("to first token", start, r.first_token + shift, tid, {}))
                events.append(_span("decode", r.first_token + shift, end, tid, {}))
            for t, n in r.events:
                events.append(
                    {
                        "name": "token",
                        "ph": "i",
                        "s": "t",
                        "pid": CLIENT_PID,
                        "tid": tid,
                        "ts": _us(t + shift),
                        "args": {"n": n},
                    }
                )
    events += _worker_events(data, worker or [])
    stages: dict[str, dict[str, float]] = {}
    t0 = _gateway_origin(gateway, sent_abs) if gateway else None
    if t0 is not None:
        for e in gateway:
            if e.get("ph") == "M":
                continue
            e = dict(e)
            e["pid"] = GATEWAY_PID
            if "ts" in e:
                e["ts"] = round(e["ts"] + t0 * 1e6, 1)
            events.append(e)
            rid = _client_id(e)
            if e.get("ph") == "i" and rid:
                stages.setdefault(rid, {})[e["name"]] = e["ts"] / 1e6
        events.append(_process_name(GATEWAY_PID, "mlxd gateway (shifted onto the client clock)"))
    return events, stages


def _worker_events(data: dict[str, Any], worker: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worker's steps as spans of their own process, on the trace axis."""
    starts = [float(r.get("t0", 0.0)) for r in (data.get("scenarios") or {}).values()]
    if not worker or not starts:
        return []
    origin = min(starts)
    events = [_process_name(WORKER_PID, "mlxd worker (engine steps)")]
    for s in worker:
        if s.get("warmup"):
            continue
        end = float(s["t"]) - origin
        name = f"step +{s['prompt_tokens']} prompt" if s.get("prompt_tokens") else "decode step"
        span = _span(name, end - float(s["s"]), end, 1, s)
        span["pid"] = WORKER_PID
        events.append(span)
    return events


def _process_name(pid: int, name: str) -> dict[str, Any]:
    """Chrome trace metadata naming process `pid`."""
    return {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}


def _client_id(event: dict[str, Any]) -> str | None:
    """The id the client sent (X-Request-ID): the gateway logs it beside its own."""
    args = event.get("args") or {}
    rid = args.get("client_request_id") or args.get("request_id")
    return str(rid) if rid else None


def _gateway_origin(gateway: list[dict[str, Any]], sent: dict[str, float]) -> float | None:
    """The gateway trace's origin on the client axis: arrival >= sent for every request."""
    lows = []
    for e in gateway:
        rid = _client_id(e)
        if e.get("name") == "arrival" and e.get("ph") == "i" and rid in sent:
            lows.append(sent[rid] - e["ts"] / 1e6)
    return max(lows) if lows else None


def _rid(request_id: str) -> str:
    return "bench-" + request_id.replace("/", "-")


def _lane(lanes: list[float], start: float, end: float) -> int:
    for i, busy in enumerate(lanes):
        if busy <= start:
            lanes[i] = end
            return i + 1
    lanes.append(end)
    return len(lanes)


def _us(t: float) -> float:
    return round(t * 1e6, 1)


def _span(name: str, a: float, b: float, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": CLIENT_PID,
        "tid": tid,
        "ts": _us(a),
        "dur": round(max(0.0, b - a) * 1e6, 1),
        "args": args,
    }


def summary_markdown(
    data: dict[str, Any],
    stages: dict[str, dict[str, float]],
    model_dir: Path,
    cfg: TraceConfig,
    mixed_steps: list[dict[str, Any]] | None = None,
) -> str:
    lines = [
        "# bench trace: where the time goes",
        "",
        f"- Model: `{model_dir}` ({models.model_facts(model_dir, cfg.shape)['identity']})",
        f"- Command: `python -m bench {' '.join(cfg.argv)}`",
        "- Tracing was on (the gateway's --trace-file): numbers here are for reading, "
        "not for comparing with `bench run`.",
        "",
    ]
    lines += [
        "## Client-side stages (ms, mean / p50)",
        "",
        "Worker step: the mean of the worker's own step times during the scenario",
        "(`runner.step`, from its step log via `mlxd_worker_step_seconds`), prefill",
        "steps included; gap - step is what the worker loop, IPC, gateway and client",
        "add to each step as the client sees it.",
        "",
        "| scenario | requests | sent→response | sent→first token | decode (first "
        "token→done) | mean gap | worker steps | worker step | gap - step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    all_recs: list[tuple[str, RequestRecord, float]] = []
    offsets = _scenario_offsets(data)
    for name, res in (data.get("scenarios") or {}).items():
        recs = [RequestRecord.from_json(r) for w in res["waves"] for r in w["requests"]]
        all_recs += [(name, r, offsets[name]) for r in recs]
        ok = [r for r in recs if r.ok and r.cancelled_at is None]
        resp = [r.first_byte - r.sent for r in ok if r.first_byte is not None]
        ttft = [r.first_token - r.sent for r in ok if r.first_token is not None]
        dec = [
            r.done - r.first_token for r in ok if r.done is not None and r.first_token is not None
        ]
        gaps = [g for r in ok for g in r.gaps()]
        worker = res.get("worker_steps") or {}
        step = worker.get("mean_s")
        gap_mean = mean(gaps)
        lines.append(
            f"| {name} | {len(recs)} | {_ms2(resp)} | {_ms2(ttft)} | {_ms2(dec)} | "
            f"{_ms(gap_mean)} | {worker.get('count', '-')} | {_ms(step)} | "
            f"{_ms(None if gap_mean is None or step is None else gap_mean - step)} |"
        )
    lines.append("")
    if stages:
        lines += [
            "## TTFT split with the gateway's trace (ms, mean)",
            "",
            "Network: client sent → gateway arrival; tokenize: arrival → tokenized; "
            "queue: tokenized → admitted; submit: admitted → submitted to the worker; "
            "worker: submitted → first token in the gateway (worker queue, prefill, "
            "first decode step, IPC); delivery: gateway first token → client first token.",
            "",
            "| scenario | n | network | tokenize | queue | submit | worker | delivery | TTFT |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        per: dict[str, dict[str, list[float]]] = {}
        for name, r, off in all_recs:
            st = stages.get(_rid(r.id))
            if not st or r.first_token is None or not r.ok or r.cancelled_at is not None:
                continue
            sent, first = r.sent + off, r.first_token + off
            d = per.setdefault(name, {k: [] for k in TTFT_PARTS})
            _add(d["network"], st.get("arrival"), sent)
            _add(d["tokenize"], st.get("tokenized"), st.get("arrival"))
            _add(d["queue"], st.get("admitted"), st.get("tokenized"))
            _add(d["submit"], st.get("submitted"), st.get("admitted"))
            _add(d["worker"], st.get("first_token"), st.get("submitted"))
            _add(d["delivery"], first, st.get("first_token"))
            d["ttft"].append(first - sent)
        for name, d in per.items():
            lines.append(
                f"| {name} | {len(d['ttft'])} | "
                + " | ".join(_ms(mean(d[k])) for k in TTFT_PARTS)
                + " |"
            )
        lines.append("")
        lines += _wave_admission(data, stages)
    else:
        lines += [
            "No gateway trace (the server was not started by the benchmark, or it wrote "
            "none): only client-side stages.",
            "",
        ]
    if mixed_steps:
        lines += [
            "## mlxd's steps under mixed pressure",
            "",
            "The worker's step trace from the long prompt's arrival to just past its "
            "first token (bench/steps.py).",
            "",
            *steps.steps_table(mixed_steps),
            "",
        ]
    return "\n".join(lines) + "\n"


def _wave_admission(data: dict[str, Any], stages: dict[str, dict[str, float]]) -> list[str]:
    """Per sweep level: how far apart a wave's requests reached the worker, and
    whether their first tokens came out of one step (the arrival window and the
    worker's quiet period exist for this; issue #12, session 7)."""
    rows = []
    for name, res in (data.get("scenarios") or {}).items():
        if res.get("kind") != "sweep":
            continue
        together, submit_spread, first_spread = 0, [], []
        waves = res.get("waves") or []
        for w in waves:
            st = [stages.get(_rid(r["id"])) or {} for r in w["requests"]]
            sub = [x["submitted"] for x in st if "submitted" in x]
            first = [x["first_token"] for x in st if "first_token" in x]
            if len(sub) > 1:
                submit_spread.append(max(sub) - min(sub))
            if len(first) > 1:
                first_spread.append(max(first) - min(first))
                # One step's tokens reach the gateway in one frame: microseconds apart.
                together += max(first) - min(first) < ONE_FRAME_S
        if first_spread:
            rows.append(
                f"| {name} | {len(waves)} | {together} | {_ms(mean(submit_spread))} | "
                f"{_ms(mean(first_spread))} |"
            )
    if not rows:
        return []
    return [
        "## Waves at the worker (sweep levels)",
        "",
        "Submit spread: first to last of a wave's requests submitted to the worker; "
        "first-token spread: first to last first token in the gateway. A wave whose "
        "first tokens came out of one worker step has a first-token spread under 1 ms.",
        "",
        "| scenario | waves | waves in one step | submit spread | first-token spread |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


def _add(xs: list[float], a: float | None, b: float | None) -> None:
    if a is not None and b is not None:
        xs.append(max(0.0, a - b))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


def _ms2(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{_ms(mean(xs))} / {_ms(percentile(xs, 50))}"
