"""bench/: the load benchmark's machinery on the tiny random model.

One real `python -m bench run --preset test` (the BatchGenerator ceiling,
mlxd's engine in-process, mlxd and mlx_lm.server, every scenario kind) and one
`python -m bench trace`, checked for the structure of what they write, not for
timings. Plus fast unit checks of the pieces that decide numbers: percentiles,
the bootstrap interval, the seeded workload, the SSE client, the Prometheus
parsing, and results written before the engine target existed.
"""

from __future__ import annotations

import asyncio
import copy
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench import admit_probe, alloc_probe, cost_replay, interleave, models, run
from bench.analysis import paired_run, ratio_spread, relative_spread, wave_seconds, waves_for
from bench.client import Target, make_session, send
from bench.compare import compare, compare_files
from bench.progress import Progress
from bench.report import markdown
from bench.scenarios import counter_delta, histogram_delta
from bench.stats import bootstrap_relative_change, percentile
from bench.workload import PRESETS, RequestSpec, build_workload

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = {
    "sweep_c1",
    "sweep_c2",
    "nonstream",
    "long_prefill",
    "sustained_decode",
    "shared_prefix",
    "mixed_pressure",
    "slow_readers",
    "cancel_prefill",
    "cancel_decode",
}
IN_PROCESS_SCENARIOS = {"sweep_c1", "sweep_c2", "long_prefill", "sustained_decode"}
RATIO_KEYS = (
    "mlxd",
    "ceiling",
    "engine",
    "peer",
    "mlxd_over_ceiling",
    "mlxd_over_peer",
    "engine_over_ceiling",
    "mlxd_over_engine",
)


def _bench(
    *args: str, module: str = "bench", timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    # Its own process group: on a timeout the servers it started go with it
    # (killed, the bench cannot stop them itself).
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    r = _bench(
        "run", "--preset", "test", "--model", str(tiny_model_dir), "--out", str(out), "--quiet"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _assert_canned_replies_were_sent(res: dict, model_dir: Path) -> None:
    """Every later turn's prompt is the conversation with the canned replies
    (the tiny model's weights are random), as the chat template renders it."""
    from bench.models import Tokenizer

    (spec,) = [s for s in res["workload"]["scenarios"] if s["name"] == "shared_prefix"]
    replies = spec["params"]["replies"]
    render = Tokenizer(model_dir).render
    recs = {
        r["id"]: r
        for w in res["targets"]["mlxd"]["scenarios"]["shared_prefix"]["waves"]
        for r in w["requests"]
    }
    checked = 0
    for turns in spec["groups"].values():
        messages: list[dict[str, str]] = []
        for turn in turns:
            messages = [*messages, *turn["messages"]]
            assert recs[turn["id"]]["prompt_tokens"] == len(render(messages)), turn["id"]
            checked += 1
            messages = [*messages, {"role": "assistant", "content": replies[turn["id"]]}]
    assert checked >= 2


def test_run_measures_every_target(bench_run: Path, tiny_model_dir: Path) -> None:
    res = json.loads((bench_run / "results.json").read_text())
    assert set(res["targets"]) == {"ceiling", "engine", "mlxd", "peer"}, res["skipped"]
    assert res["model"]["identity"] and res["versions"]["mlx-lm"] and res["machine"]["cpu_count"]
    assert res["workload"]["digest"] and res["workload"]["preset"]["name"] == "test"
    summary = res["summary"]
    assert set(summary["mlxd"]) == SCENARIOS == set(summary["peer"])
    assert set(summary["ceiling"]) == IN_PROCESS_SCENARIOS == set(summary["engine"])
    for target in ("engine", "mlxd", "peer"):
        for name, s in summary[target].items():
            assert s["errors"] == 0, (target, name, s["error_samples"])
    engine = res["targets"]["engine"]
    assert engine["driver"] == "engine" and engine["engine"]["pacing"] is True
    assert engine["stats"]["finish_reasons"] and engine["weights_bytes"] > 0
    # The sweep's throughput has all four targets and every ratio.
    for scen in ("sweep_c1", "sweep_c2"):
        sweep = [
            r for r in res["ratios"] if r["scenario"] == scen and r["metric"] == "output tok/s"
        ]
        assert len(sweep) == 1
        assert all(sweep[0][k] for k in RATIO_KEYS), sweep[0]
    # Cancellations were made at the stage they aim at; mlxd's worker saw them retire.
    # A decode cancellation leaves after a token count; a prefill one after a
    # fraction of the idle TTFT, which on a loaded machine may already hold a
    # token: the stage it lands in is a timing, not the machinery's output.
    assert summary["mlxd"]["cancel_decode"]["stages"] == {"decode": 1}
    prefill_stages = summary["mlxd"]["cancel_prefill"]["stages"]
    assert sum(prefill_stages.values()) == 1 and set(prefill_stages) <= {"prefill", "decode"}
    for name in ("cancel_prefill", "cancel_decode"):
        assert summary["mlxd"][name]["cancel_to_retire_ms"]["n"] == 1
    assert summary["mlxd"]["shared_prefix"]["warm_cached_tokens"] > 0
    _assert_canned_replies_were_sent(res, tiny_model_dir)
    # mlxd's own step times per scenario (the serving path's cost is gap - step);
    # the peer exports none.
    steps = res["targets"]["mlxd"]["scenarios"]["sweep_c1"]["worker_steps"]
    assert steps["count"] > 0 and steps["mean_s"] > 0
    assert "worker_steps" not in res["targets"]["peer"]["scenarios"]["sweep_c1"]
    # Each server process's CPU over each scenario: mlxd's gateway and worker
    # apart, the peer's one process; over the whole run each did some work.
    for target, processes in (("mlxd", {"gateway", "worker"}), ("peer", {"server"})):
        scenarios = res["targets"][target]["scenarios"]
        assert all(set(s["cpu_s"]) == processes for s in scenarios.values()), target
        for proc in processes:
            assert sum(s["cpu_s"][proc] for s in scenarios.values()) > 0, (target, proc)
        assert set(summary[target]["sweep_c2"]["cpu_us_per_token"]) == processes
    mem = res["targets"]["mlxd"]["memory"]
    assert mem["before"]["governor"] and mem["after"]["governor"]
    assert {c["check"] for c in res["checks"]} >= {
        "overhead C=1",
        "mixed pressure: streams' p99 ITL",
        "shared prefix: cold / warm TTFT",
        "memory: live state back to resting",
    }
    assert res["parity"]["mlxd_vs_ceiling_token_ids"]["compared"] > 0
    assert res["parity"]["mlxd_vs_peer_text"]["compared"] > 0
    # Greedy, float32 on the CPU, same prompts and sizes: the worker's core must
    # choose exactly the tokens the raw BatchGenerator chooses.
    engine_parity = res["parity"]["engine_vs_ceiling_token_ids"]
    assert engine_parity["compared"] == sum(s["requests"] for s in summary["ceiling"].values())
    assert engine_parity["identical"] == engine_parity["compared"], engine_parity


def test_report_has_every_target_row(bench_run: Path) -> None:
    report = (bench_run / "report.md").read_text()
    for target in ("mlxd", "ceiling", "engine", "peer"):
        assert f"| sweep_c1 | {target} |" in report
    for heading in (
        "## Issue #6 targets",
        "## mlxd against the ceiling, its own engine",
        "## Mixed prefill/decode pressure",
        "## Shared-prefix reuse",
        "## Cancellations",
        "## Memory at rest",
        "## Token parity",
        "## CPU per output token",
    ):
        assert heading in report
    assert "| sweep_c1 | output tok/s |" in report
    assert "| engine/ceiling | mlxd/engine | mlxd/ceiling | mlxd/peer |" in report
    assert "## Throughput ratios with their spread" in report
    assert "- engine: mlxd's EngineCore over Runner in-process" in report
    assert "engine vs ceiling token ids:" in report


def test_results_without_the_engine_still_load(bench_run: Path, tmp_path: Path) -> None:
    """Results written before the engine target existed: reported, merged, headlined."""
    res = json.loads((bench_run / "results.json").read_text())
    old = copy.deepcopy(res)
    del old["targets"]["engine"]
    for row in old["ratios"]:
        for k in ("engine", "engine_over_ceiling", "mlxd_over_engine"):
            del row[k]
    del old["parity"]["engine_vs_ceiling_token_ids"]
    assert "| sweep_c1 | output tok/s |" in markdown(old)  # as stored, old keys only
    run.headline(old, io.StringIO())

    out = tmp_path / "old"
    out.mkdir()
    run.finish(old, out)  # derived again from the targets, as a new run would
    rows = [r for r in old["ratios"] if r["metric"] == "output tok/s"]
    assert rows and all(r["engine"] is None and r["mlxd_over_engine"] is None for r in rows)
    assert all(r["mlxd_over_ceiling"] for r in rows if r["scenario"] in IN_PROCESS_SCENARIOS)
    assert "engine_vs_ceiling_token_ids" not in old["parity"]
    assert "| sweep_c1 | engine |" not in (out / "report.md").read_text()

    # A later `--targets engine` into that directory keeps the three others.
    (out / "results.json").write_text(json.dumps(old))
    kept = run._earlier_targets(out, old, ("engine",))
    assert set(kept) == {"ceiling", "mlxd", "peer"}
    other = {**old, "workload": {**old["workload"], "digest": "0" * 16}}
    assert run._earlier_targets(out, other, ("engine",)) == {}

    # Another workload into that directory keeps the earlier results beside it.
    (out / "report.md").write_text("earlier report")
    assert run._set_aside(out, old) is None  # the same workload: merged, not moved
    moved = run._set_aside(out, other)
    assert moved is not None and not (out / "results.json").exists()
    assert json.loads((out / moved).read_text())["workload"] == old["workload"]
    assert (out / moved.replace("results", "report").replace(".json", ".md")).read_text() == (
        "earlier report"
    )


def test_compare_verdicts(bench_run: Path, tmp_path: Path) -> None:
    path = bench_run / "results.json"
    assert compare_files(path, path) == 0
    base = json.loads(path.read_text())

    other = copy.deepcopy(base)
    other["workload"]["digest"] = "0" * 16
    assert compare(base, other)["refused"]
    changed = tmp_path / "other.json"
    changed.write_text(json.dumps(other))
    assert compare_files(path, changed) == 2

    drift = copy.deepcopy(base)
    req = drift["targets"]["mlxd"]["scenarios"]["sweep_c2"]["waves"][0]["requests"][0]
    req["token_ids"] = [t + 1 for t in req["token_ids"]]
    result = compare(base, drift)
    assert result["verdict"] == "TOKEN PARITY FAILED" and result["parity"]["mismatches"] == 1


def test_trace_writes_chrome_trace_and_summary(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace"
    r = _bench(
        "trace",
        "--preset",
        "test",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(out),
        "--scenarios",
        "sweep_c2",
        "--quiet",
        "--mlxd-env",
        "MLXD_ARRIVAL_QUIET_S=0.05",
        # One chunk size that holds every prompt: otherwise the idle plan may cut
        # the longer prompt in two (its cost model is timed, and a loaded machine
        # times it differently), and its first token would come a step later.
        "--mlxd-env",
        "MLXD_CHUNK_BUCKETS=64",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    pids = {e["pid"] for e in events}
    assert pids == {1, 2, 3}  # the bench client, the gateway's trace, the worker's steps
    # The worker's steps sit on the client's axis (both CLOCK_MONOTONIC): the
    # pass over the prompts ends before any client sees a first token.
    prefill_ends = [
        e["ts"] + e["dur"] for e in events if e["pid"] == 3 and e["name"].startswith("step +")
    ]
    first_tokens = [
        e["ts"] + e["dur"] for e in events if e["pid"] == 2 and e["name"] == "to first token"
    ]
    assert prefill_ends and first_tokens
    assert min(prefill_ends) <= min(first_tokens)
    assert any(e["name"] == "token" for e in events)
    assert any(e.get("ph") == "X" and e["name"] == "to first token" for e in events)
    md = (out / "trace.md").read_text()
    assert "| sweep_c2 | 2 |" in md and "TTFT split" in md
    # The wave of two reached the idle worker together (a 50 ms quiet period on
    # a loaded machine) and its first tokens came out of one step.
    assert "## Waves at the worker" in md and "| sweep_c2 | 1 | 1 |" in md, md
    scenarios = json.loads((out / "scenarios.json").read_text())["scenarios"]
    reqs = [r for w in scenarios["sweep_c2"]["waves"] for r in w["requests"]]
    assert reqs and all(r["ok"] for r in reqs)


def test_pacing_probe_runs_uncalibrated_then_calibrated(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "probe.json"
    r = _bench(
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "600",
        "--calibrate-s",
        "0.3",
        "--profile",
        "--out",
        str(out),
        module="bench.pacing_probe",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    runs = json.loads(out.read_text())["runs"]
    for probe in runs:  # --profile: where the paced steps and a steady one went
        profiles = probe["profiles"]
        assert set(profiles) == {"steady", "first", "slowest", "finishing", "after"}
        assert "worker/core.py" in profiles["slowest"] and "(step)" in profiles["steady"]
    assert "-- finishing step" in r.stdout
    assert [probe["calibrate_s"] for probe in runs] == [0.0, 0.3]
    uncalibrated, calibrated = runs
    # without calibration the cost model is unfitted when the warm-up ends; with
    # it the model has measured prefill passes before any prompt came
    assert not uncalibrated["warmup_cost_model"]
    assert calibrated["warmup_cost_model"]
    for probe in runs:
        assert sum(p for _, p, _ in probe["steps"]) == 600  # the whole prompt, its last token too
        assert probe["steady_step_ms"] > 0 and probe["long_ttft_ms"] > 0
        assert len(probe["after"]) == 3


def test_pacing_probe_sync_times_each_step_whole_and_lets_the_prompt_decode(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "probe.json"
    args = ("--prompt", "300", "--calibrate-s", "0.2", "--calibrated-only", "--sync")
    r = _bench(
        "--model",
        str(tiny_model_dir),
        *args,
        "--long-tokens",
        "8",
        "--after",
        "2",
        "--repeat",
        "2",
        "--trace",
        str(tmp_path / "trace"),
        "--count-ops",
        "--out",
        str(out),
        module="bench.pacing_probe",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (probe,) = json.loads(out.read_text())["runs"]
    assert probe["sync"] and probe["calibrate_s"] == 0.2 and not probe["profiles"]
    # --count-ops: a decode step's primitives, then each step of one more
    # arrival's, which carry its prompt's matmuls beside the decode rows'
    ops = probe["ops"]
    assert list(ops)[:2] == ["decode", "arrival1"]
    assert ops["arrival1"]["Matmul"] > ops["decode"]["Matmul"] > 0
    assert "primitives {" in r.stdout
    # the steps end at the prompt's first token (it goes on decoding after it)
    assert sum(p for _, p, _ in probe["steps"]) == 300
    assert [p for _, p, _ in probe["after"]] == [0, 0]
    # --trace: every step after the warm-up, with the cost model's prediction
    paced = [t for t in probe["trace"] if t["prompt_tokens"] and t["decoding"]]
    # (the two timed arrivals and the counted one)
    assert sum(t["prompt_tokens"] for t in paced) == 3 * 300 and all(
        t["predicted_s"] > 0 for t in paced
    )
    (again,) = probe["repeats"]  # --repeat 2: the same length once more
    assert sum(p for _, p, _ in again["steps"]) == 300 and len(again["after"]) == 2
    for seconds, _, host in probe["steps"] + probe["after"] + again["steps"]:
        assert 0 < host <= seconds  # the host's part, then the wait for the device


def test_shape_probe_times_each_op_twice_and_both_joins(tmp_path: Path) -> None:
    out = tmp_path / "shapes.json"
    r = _bench("--shape", "tiny", "--out", str(out), module="bench.shape_probe")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    for op in ("gemm", "prefill_attention", "decode_attention"):
        assert result[op] and all(a > 0 and b > 0 for a, b in result[op].values())
    assert len(result["join"]) == 3 and len(result["join_one_write"]) == 3
    assert len(result["join_rows"]) == 3 and len(result["join_rows_grown"]) == 3
    assert "join as one write per array" in r.stdout
    assert "join into the rows layout's room" in r.stdout
    only = tmp_path / "joins.json"
    r = _bench("--shape", "tiny", "--joins-only", "--out", str(only), module="bench.shape_probe")
    assert r.returncode == 0, r.stdout + r.stderr
    joins = json.loads(only.read_text())
    assert not joins["gemm"] and all(v > 0 for v in joins["join_rows"])


def test_decode_probe_times_both_paths_and_compares_their_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's harness on the CPU, with mlx-lm's own attention standing in
    for the CUDA kernel: every batch timed both ways, outputs compared (equal
    here). Without CUDA the command says the kernel is missing."""
    from bench import decode_probe
    from bench.models import SHAPES
    from worker import decode_attention as da

    assert _bench("--shape", "tiny", module="bench.decode_probe").returncode == 2
    monkeypatch.setattr(decode_probe, "BATCHES", decode_probe.BATCHES[:4])
    monkeypatch.setattr(
        da,
        "ragged_attention",
        lambda q, k, v, mask, scale: da.MLX_LM_ATTENTION(
            q, k, v, cache=None, scale=scale, mask=mask
        ),
    )
    result = decode_probe.probe(SHAPES["tiny"], reps=2)
    assert len(result) == 4
    for entry in result.values():
        assert all(entry[f"{k}_ms"] > 0 for k in ("mlx", "kernel", "mlx_again"))
        assert entry["max_abs_diff"] == 0
        assert entry["max_abs_out"] > 0
    assert result["16 rows at 512, one at 2000"]["rows"] == 17


def test_prefix_probe_times_cold_and_warm_turns(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    args = ("--history", "300", "--turns", "2", "--reply", "8", "--user", "16")
    r = _bench(
        "--model",
        str(tiny_model_dir),
        *args,
        "--conversations",
        "2",
        "--chunk-start",
        "both",
        "--profile",
        "--out",
        str(out),
        module="bench.prefix_probe",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["conversation_modes"] == ["chunk_start", "last_token_pass"]
    assert set(result["modes"]) == {"chunk_start", "last_token_pass"}
    (cold, warm), (_, warm_off) = result["conversations"]
    assert cold["cached_tokens"] == 0 and cold["prompt_tokens"] == 300
    # the warm turn reuses the history and the reply the cache kept
    assert warm["prompt_tokens"] == 300 + 8 + 16 and warm["cached_tokens"] >= 300
    # its prefill is only what the cache did not hold, in one step: the first
    # token comes from that pass (worker/fused.py, chunk_start)
    (only,) = warm["steps_to_first_token"]
    assert only[1] == warm["prompt_tokens"] - warm["cached_tokens"]
    assert warm["ttft_ms"] > 0 and warm["lookup_ms"] > 0
    # mlx-lm's order: the chunk less the last token, then a step for that token
    chunk, last = warm_off["steps_to_first_token"]
    assert (chunk[1], last[1]) == (warm_off["prompt_tokens"] - warm_off["cached_tokens"] - 1, 0)
    # --profile keeps the slowest warm turn's profile: the step is in it
    slowest = max(warm["ttft_ms"], warm_off["ttft_ms"])
    assert result["profile_slowest_warm_ttft_ms"] == slowest
    profile = result["profile_slowest_warm"]
    assert "step" in profile and "cumulative" in profile
    assert cold["queued_before_ms"] is None  # only --sync waits for the device


def test_prefix_probe_sync_times_each_stage_to_the_device(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--sync: each stage's device work is waited for in its own column, so the
    first step holds only its own pass."""
    out = tmp_path / "prefix-sync.json"
    r = _bench(
        "--model", str(tiny_model_dir), "--history", "200", "--turns", "2", "--reply", "4",
        "--user", "8", "--conversations", "1", "--sync", "--out", str(out),
        module="bench.prefix_probe",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (turns,) = json.loads(out.read_text())["conversations"]
    for t in turns:
        assert t["queued_before_ms"] is not None and t["queued_before_ms"] >= 0
        assert t["lookup_ms"] > 0 and t["insert_ms"] > 0
    assert "queued before" in r.stdout


def test_prefix_probe_reply_as_other_reuses_the_previous_prompt_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--reply-as other: the benchmark's turns, whose replies come back as other
    tokens; the warm turn prefills the reply and the new message."""
    out = tmp_path / "prefix-other.json"
    r = _bench(
        "--model", str(tiny_model_dir), "--history", "200", "--turns", "2", "--reply", "6",
        "--user", "8", "--conversations", "1", "--reply-as", "other", "--out", str(out),
        module="bench.prefix_probe",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ((cold, warm),) = json.loads(out.read_text())["conversations"]
    assert warm["prompt_tokens"] == 200 + 6 + 8
    assert warm["cached_tokens"] == cold["prompt_tokens"] == 200
    (only,) = warm["steps_to_first_token"]
    assert only[1] == 6 + 8


# -- fast unit checks ----------------------------------------------------------------


def test_cpu_per_token_divides_each_process_by_the_scenarios_tokens() -> None:
    from bench.analysis import cpu_per_token

    wave = {"requests": [{"tokens": 300}, {"tokens": 100}]}
    result = {"waves": [wave, wave], "cpu_s": {"gateway": 0.04, "worker": 0.2}}
    assert cpu_per_token(result) == {"gateway": 50.0, "worker": 250.0}
    assert cpu_per_token({"waves": [{"requests": [{"tokens": 0}]}], "cpu_s": {"server": 1}}) == {}
    assert cpu_per_token({"waves": [wave]}) == {}  # written before CPU was measured


def test_percentile_and_bootstrap() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    same = bootstrap_relative_change([1.0, 1.1, 0.9] * 10, [1.0, 1.1, 0.9] * 10)
    assert same is not None and same[1] <= 0 <= same[2]
    slower = bootstrap_relative_change([1.0, 1.1, 0.9] * 10, [2.0, 2.2, 1.8] * 10)
    assert slower is not None and slower[1] > 0.5


def _fake_render(messages: list[dict[str, str]]) -> list[int]:
    words = sum(len(m["content"].split()) for m in messages)
    return list(range(4 * len(messages) + words))


def test_workload_is_seeded_and_sized() -> None:
    preset = PRESETS["test"]
    a = build_workload(preset, _fake_render, seed=0)
    b = build_workload(preset, _fake_render, seed=0)
    c = build_workload(preset, _fake_render, seed=1)
    assert a.digest() == b.digest() != c.digest()
    long = a.scenario("long_prefill").groups["requests"][0]
    assert preset.long_prompt_tokens - 1 <= len(long.prompt_ids) <= preset.long_prompt_tokens
    assert [len(g) for g in a.scenario("sweep_c2").groups.values()] == [2] * preset.waves
    assert a.max_concurrency() >= max(preset.concurrency)
    json.dumps(a.describe())  # the results file keeps it


def test_canned_replies_change_only_the_shared_prefix_replies() -> None:
    """Random weights: the conversations send back fixed replies of about
    `prefix_turn_tokens` tokens (a random model's own reply re-tokenizes about
    15x longer); every request of every scenario stays the same."""
    preset = PRESETS["standard"]
    own = build_workload(preset, _fake_render, seed=0)
    canned = build_workload(preset, _fake_render, seed=0, canned_replies=True)
    assert "replies" not in own.scenario("shared_prefix").params
    replies = canned.scenario("shared_prefix").params["replies"]
    turns = canned.scenario("shared_prefix").requests()
    assert set(replies) == {t.id for t in turns} and len(turns) == 16
    sizes = {len(_fake_render([{"role": "user", "content": r}])) for r in replies.values()}
    assert preset.prefix_turn_tokens - 2 <= min(sizes) <= max(sizes) <= preset.prefix_turn_tokens
    assert len(set(replies.values())) == len(replies)
    for a, b in zip(own.scenarios, canned.scenarios, strict=True):
        assert [r.public() for r in a.requests()] == [r.public() for r in b.requests()]
        assert [r.prompt_ids for r in a.requests()] == [r.prompt_ids for r in b.requests()]
    assert own.digest() != canned.digest()


def test_low_levels_get_more_waves_and_ratios_their_spread() -> None:
    """The standard preset runs at least 32 requests per level (a ratio's spread
    at C=1 over three waves was wider than the differences it had to show)."""
    std = PRESETS["standard"]
    assert [std.waves_at(c) for c in std.concurrency] == [32, 8, 4, 3, 3, 3]
    a = build_workload(std, _fake_render, seed=0)
    assert len(a.scenario("sweep_c1").groups) == 32
    assert relative_spread([100.0]) is None
    assert relative_spread([100.0, 100.0]) == 0.0
    wide, narrow = relative_spread([90.0, 110.0]), relative_spread([90.0, 110.0] * 8)
    assert wide is not None and narrow is not None and narrow < wide / 3
    assert ratio_spread({"tok_s_spread": 0.03}, {"tok_s_spread": 0.04}) == 0.05
    assert ratio_spread({"tok_s_spread": 0.03}, {}) is None


def test_paired_spread_drops_what_both_waves_of_a_pair_shared() -> None:
    """Interleaved, wave i of two targets ran seconds apart: a drift that moves
    both (the machine's state, the wave's prompts) cancels in their ratio."""
    drifting = [100.0, 160.0, 100.0, 160.0]
    a = {"wave_tok_s": drifting, "tok_s_spread": relative_spread(drifting)}
    b = {"wave_tok_s": [x / 2 for x in drifting], "tok_s_spread": relative_spread(drifting)}
    unpaired = ratio_spread(a, b)
    assert unpaired is not None and unpaired > 0.2
    assert ratio_spread(a, b, paired=True) == 0.0  # the ratio was 2 in every pair
    noisy = {"wave_tok_s": [50.0, 85.0, 48.0, 80.0]}
    paired = ratio_spread(a, noisy, paired=True)
    assert paired is not None and 0.0 < paired < unpaired
    # Waves that do not pair up (a level one target did not finish) fall back.
    short = {"wave_tok_s": [50.0, 80.0], "tok_s_spread": 0.1}
    assert ratio_spread(a, short, paired=True) == ratio_spread(a, short)
    log = {"waves": [{"target": "ceiling"}, {"target": "mlxd"}]}
    assert paired_run({"targets": {"ceiling": {}, "mlxd": {}}, "interleave": log})
    # A target merged from an earlier (sequential) run into the directory: unpaired.
    assert not paired_run({"targets": {"ceiling": {}, "mlxd": {}, "peer": {}}, "interleave": log})
    assert not paired_run({"targets": {"ceiling": {}}})


def test_waves_for_a_spread_goal_scale_with_its_square() -> None:
    """What one run's spread says about the waves a tighter one needs (#12's
    +-0.03), and what they would cost at the run's seconds per wave."""
    assert waves_for(0.06, 8, 0.03) in (32, 33)  # twice as wide: four times the waves
    assert waves_for(0.01, 8, 0.03) == 8  # already inside: no fewer than it ran
    assert waves_for(None, 8, 0.03) is None and waves_for(0.06, 1, 0.03) is None
    log = {
        "waves": [
            {"scenario": "sweep_c1", "target": "ceiling", "start": 0.0, "end": 1.0},
            {"scenario": "sweep_c1", "target": "mlxd", "start": 1.0, "end": 3.0},
            {"scenario": "sweep_c1", "target": "ceiling", "start": 3.0, "end": 6.0},
        ]
    }
    assert wave_seconds({"interleave": log}) == {"sweep_c1": 4.0}  # 2 + 2
    assert wave_seconds({}) == {}


def test_interleaved_run_alternates_the_targets_wave_by_wave(
    tiny_model_dir: Path, tmp_path: Path, bench_run: Path
) -> None:
    out = tmp_path / "interleaved"
    r = _bench(
        "run", "--preset", "test", "--model", str(tiny_model_dir), "--out", str(out),
        "--quiet", "--interleave", "--targets", "ceiling,engine,mlxd",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((out / "results.json").read_text())
    targets = ("ceiling", "engine", "mlxd")
    assert set(res["targets"]) == set(targets), res["skipped"]
    summary = res["summary"]
    assert set(summary["mlxd"]) == SCENARIOS
    assert set(summary["ceiling"]) == IN_PROCESS_SCENARIOS == set(summary["engine"])
    for target in targets:
        for name, s in summary[target].items():
            assert s["errors"] == 0, (target, name, s["error_samples"])
    log = res["interleave"]["waves"]
    # Every wave of every paired scenario ran on each target, never two at once,
    # and who went first rotated from one wave to the next.
    ran: dict[tuple[str, int], list[str]] = {}
    for w in log:
        ran.setdefault((w["scenario"], w["wave"]), []).append(w["target"])
    assert {scen for scen, _ in ran} == IN_PROCESS_SCENARIOS
    assert all(sorted(names) == sorted(targets) for names in ran.values())
    firsts = [names[0] for names in ran.values()]
    assert firsts[:3] == ["ceiling", "engine", "mlxd"], firsts
    for before, after in itertools.pairwise(log):
        assert after["start"] >= before["end"]
    # Each target's waves really ran inside the slot the log gives them (every
    # process reads the same monotonic clock).
    for w in log:
        scen = res["targets"][w["target"]]["scenarios"][w["scenario"]]
        if w["target"] == "mlxd":
            sent = min(r["sent"] for r in scen["waves"][w["wave"]]["requests"]) + scen["t0"]
        else:
            sent = scen["waves"][w["wave"]]["t0"]
        assert w["start"] <= sent <= w["end"], (w, sent)
    # The journal, written as the waves ended, says the same, with each wave's rate.
    journal = [json.loads(line) for line in (out / "waves.jsonl").read_text().splitlines()]
    assert [{k: j[k] for k in log[0]} for j in journal] == log
    for j in journal:
        assert j["tok_s"] == pytest.approx(j["output_tokens"] / (j["end"] - j["start"]), rel=1e-3)
        if j["target"] == "mlxd":  # the tokens it names are the ones mlxd sent
            wave = res["targets"]["mlxd"]["scenarios"][j["scenario"]]["waves"][j["wave"]]
            assert j["output_tokens"] == sum(r["tokens"] for r in wave["requests"]) > 0
    engine_parity = res["parity"]["engine_vs_ceiling_token_ids"]
    assert engine_parity["identical"] == engine_parity["compared"] > 0
    report = (out / "report.md").read_text()
    assert "- Order: interleaved" in report
    assert "| waves for ±0.03 | seconds |" in report
    assert "- Order: one target after another" in (bench_run / "report.md").read_text()


class _FakeScenario:
    name, kind = "sweep_c1", "sweep"

    def waves(self) -> list[list[Any]]:
        return [[], [], [], []]


class _FakeChild:
    """Runs waves instantly; the deadline passes during wave `late`."""

    def __init__(self, run: interleave._Run, late: int) -> None:
        self.run, self.late, self.ran = run, late, []

    async def wave(self, scenario: str, index: int) -> float:
        self.ran.append(index)
        if index == self.late:
            self.run.deadline = 0.0  # time.monotonic() is past it from now on
        return 0.0


def test_a_deadline_ends_a_paired_scenario_after_a_wave_every_target_ran() -> None:
    """Waves stay paired (wave i ran on every target) when the deadline cuts a
    scenario short, and the cut is recorded; a scenario past it never starts."""
    run = interleave._Run(
        workload=None,  # type: ignore[arg-type]
        progress=Progress(1, enabled=False),
        order=["a", "b"],
        deadline=float("inf"),
    )
    a, b = _FakeChild(run, late=1), _FakeChild(run, late=-1)
    run.children = {"a": a, "b": b}  # type: ignore[dict-item]
    asyncio.run(interleave._paired(run, _FakeScenario()))  # type: ignore[arg-type]
    assert a.ran == b.ran == [0, 1]
    assert [(w["wave"], w["target"]) for w in run.log] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert run.cut == ["sweep_c1"]
    asyncio.run(interleave._paired(run, _FakeScenario()))  # type: ignore[arg-type]
    assert a.ran == [0, 1] and len(run.log) == 4


def test_every_target_gets_its_share_of_a_shared_gpu(tmp_path: Path) -> None:
    """Interleaved on an NVIDIA machine, each target is held to 90% of the GPU over
    the targets: MLX's limit in the in-process targets and the peer, mlxd's
    budget unless --mlxd-env sets one (session 12's five 8B processes ran the
    H200 out of memory without it)."""
    gpus = ["NVIDIA H200, 143771 MiB, 580.159.04"]
    cfg = run.RunConfig(targets=("ceiling", "ceiling_alt", "engine", "mlxd", "peer"))
    share = run.memory_share(cfg, gpus)
    assert share == int(0.9 * (143771 << 20) / 5)
    assert run.memory_share(cfg, []) is None  # CPU and Metal: no share
    assert models.gpu_memory_bytes(["A, 1000 MiB, 1", "B, 800 MiB, 1", "odd"]) == 800 << 20
    wl = build_workload(PRESETS["test"], _fake_render, seed=0)
    targets = run._Targets(cfg, wl, tmp_path, tmp_path, 4, {}, share)
    assert targets.spec("engine")["memory_limit_bytes"] == share
    assert targets.mlxd_env() == {"MLXD_MEMORY_BUDGET_BYTES": str(share)}
    own = run._Targets(
        run.RunConfig(mlxd_env={"MLXD_MEMORY_BUDGET_BYTES": "7"}), wl, tmp_path, tmp_path, 4, {}, 9
    )
    assert own.mlxd_env() == {"MLXD_MEMORY_BUDGET_BYTES": "7"}
    assert run._Targets(cfg, wl, tmp_path, tmp_path, 4, {}).mlxd_env() == {}


def test_mlx_capped_runs_the_module_under_mlx_memory_limit(tmp_path: Path) -> None:
    """The peer's wrapper: the module runs as `python -m` would run it, with MLX's
    memory limit set first."""
    mod = tmp_path / "probe_limit.py"
    mod.write_text(
        "import sys\nimport mlx.core as mx\nprint(mx.get_memory_limit(), sys.argv[1:])\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "bench.mlx_capped", str(123 << 20), "probe_limit", "--x", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(maxsplit=1) == [str(123 << 20), "['--x', '1']\n"]


def test_a_run_past_its_deadline_still_writes_its_results(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`--deadline-s 0`: every scenario is cut, yet the targets start, stop and
    report (a lent GPU's session ends on the dot; a killed run leaves nothing)."""
    out = tmp_path / "deadline"
    r = _bench(
        "run", "--preset", "test", "--model", str(tiny_model_dir), "--out", str(out),
        "--quiet", "--interleave", "--targets", "engine,mlxd", "--deadline-s", "0",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((out / "results.json").read_text())
    assert set(res["targets"]) == {"engine", "mlxd"}, res["skipped"]
    assert "sweep_c1" in res["interleave"]["cut"]
    assert "mlxd mixed_pressure" in res["interleave"]["cut"]
    assert "- Cut short by the run's deadline" in (out / "report.md").read_text()
    plain = _bench("run", "--preset", "test", "--model", str(tiny_model_dir), "--deadline-s", "5")
    assert plain.returncode == 2 and "--deadline-s needs --interleave" in plain.stderr


async def _sse_app() -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": keep-alive\n\n")
        for i in range(body["max_tokens"]):
            chunk = {
                "choices": [
                    {
                        "delta": {"content": f"t{i}"},
                        "token_ids": [i],
                        "finish_reason": "length" if i == body["max_tokens"] - 1 else None,
                    }
                ]
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.001)
        usage = {
            "choices": [],
            "usage": {
                "prompt_tokens": 7,
                "completion_tokens": body["max_tokens"],
                "prompt_tokens_details": {"cached_tokens": 3},
            },
        }
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.fixture
async def sse_url() -> AsyncIterator[str]:
    runner = web.AppRunner(await _sse_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_client_parses_sse_and_cancels(sse_url: str) -> None:
    target = Target("mlxd", sse_url, "m", token_ids=True)
    spec = RequestSpec("x/0", [{"role": "user", "content": "hi"}], [1, 2], 5)
    async with make_session() as session:
        rec = await send(session, target, spec)
        assert rec.ok and rec.tokens == 5 and rec.token_ids == [0, 1, 2, 3, 4]
        assert rec.text == "t0t1t2t3t4" and rec.finish_reason == "length"
        assert rec.prompt_tokens == 7 and rec.cached_tokens == 3
        assert len(rec.events) == 5 and len(rec.gaps()) == 4
        assert rec.sent <= rec.first_byte <= rec.first_token <= rec.done  # type: ignore[operator]

        early = RequestSpec("x/1", spec.messages, spec.prompt_ids, 50, cancel_after_tokens=2)
        rec = await send(session, target, early)
        assert rec.cancel_stage == "decode" and rec.tokens == 2 and rec.cancelled_at is not None


def test_prometheus_deltas() -> None:
    before = (
        'mlxd_cancel_to_retire_seconds_bucket{model="m",le="0.001"} 1.0\n'
        'mlxd_cancel_to_retire_seconds_bucket{model="m",le="0.01"} 1.0\n'
        'mlxd_cancel_to_retire_seconds_bucket{model="m",le="+Inf"} 1.0\n'
        'mlxd_cancel_to_retire_seconds_sum{model="m"} 0.0005\n'
        'mlxd_cancel_to_retire_seconds_count{model="m"} 1.0\n'
        'mlxd_cancellations_total{model="m",stage="decode"} 1.0\n'
    )
    after = (
        'mlxd_cancel_to_retire_seconds_bucket{model="m",le="0.001"} 2.0\n'
        'mlxd_cancel_to_retire_seconds_bucket{model="m",le="0.01"} 3.0\n'
        'mlxd_cancel_to_retire_seconds_bucket{model="m",le="+Inf"} 3.0\n'
        'mlxd_cancel_to_retire_seconds_sum{model="m"} 0.0105\n'
        'mlxd_cancel_to_retire_seconds_count{model="m"} 3.0\n'
        'mlxd_cancellations_total{model="m",stage="decode"} 2.0\n'
        'mlxd_cancellations_total{model="m",stage="prefill"} 1.0\n'
    )
    d = histogram_delta(before, after, "mlxd_cancel_to_retire_seconds")
    assert d["count"] == 2 and d["mean_s"] == pytest.approx(0.005)
    assert d["p50_le_s"] == 0.001 and d["p99_le_s"] == 0.01
    assert counter_delta(before, after, "mlxd_cancellations_total", "stage") == {
        "decode": 1,
        "prefill": 1,
    }


def test_memory_at_rest_fails_on_memory_kept_not_on_memory_given_back() -> None:
    from bench.analysis import memory_at_rest

    def snapshots(active_after: int, prefix_after: int) -> dict[str, object]:
        gov = {"live_state": 0, "reserved_growth": 0, "reserved_requests": 0}
        return {
            "before": {
                "governor": gov,
                "memory": {"active_bytes": 100 << 20},
                "prefix_cache": {"bytes": 10 << 20},
            },
            "after": {
                "governor": gov,
                "memory": {"active_bytes": active_after},
                "prefix_cache": {"bytes": prefix_after},
            },
        }

    mib = 1 << 20
    assert memory_at_rest(snapshots(150 * mib, 60 * mib))[:2] == (True, True)  # the cache grew
    assert memory_at_rest(snapshots(137 * mib, 60 * mib))[:2] == (True, True)  # 13 MiB given back
    live, kept, note = memory_at_rest(snapshots(153 * mib, 60 * mib))
    assert (live, kept) == (True, False) and f"{3 * mib:+d} B" in note


def test_memory_at_rest_counts_the_prefix_caches_buffers_not_its_contents() -> None:
    """Session 26's H100 sweep: 71 more cached entries after than before,
    and active memory less their contents 50.3 MB higher, all of it their
    buffers' page rounding. With the worker's `allocated_bytes` the check
    passes that and still fails memory kept beside it."""
    from bench.analysis import memory_at_rest

    gov = {"live_state": 0, "reserved_growth": 0, "reserved_requests": 0}

    def snapshots(active_after: int) -> dict[str, object]:
        return {
            "before": {
                "governor": gov,
                "memory": {"active_bytes": 1_821_984_840},
                "prefix_cache": {"bytes": 506_769_408, "allocated_bytes": 560_000_000},
            },
            "after": {
                "governor": gov,
                "memory": {"active_bytes": active_after},
                "prefix_cache": {"bytes": 1_070_395_392, "allocated_bytes": 1_173_800_000},
            },
        }

    after = 1_821_984_840 + (1_173_800_000 - 560_000_000)
    assert memory_at_rest(snapshots(after))[:2] == (True, True)
    assert memory_at_rest(snapshots(after + (2 << 20)))[:2] == (True, False)
    # by contents alone the same run reads as ~50 MB kept
    legacy = snapshots(after)
    for side in ("before", "after"):
        legacy[side]["prefix_cache"].pop("allocated_bytes")  # type: ignore[index]
    assert memory_at_rest(legacy)[:2] == (True, False)


def test_the_ratios_use_the_faster_ceiling_per_scenario() -> None:
    """Issue #12 item 8: both ceilings measured, mlxd is held to the better one
    in each scenario; MLX's defaults stay in the summary for the report."""
    from bench.analysis import best_ceiling, ratios

    summary = {
        "ceiling": {"sweep_c1": {"tok_s": 200.0}, "sweep_c64": {"tok_s": 3800.0}},
        "ceiling_alt": {"sweep_c1": {"tok_s": 120.0}, "sweep_c64": {"tok_s": 4600.0}},
        "mlxd": {"sweep_c1": {"tok_s": 190.0}, "sweep_c64": {"tok_s": 4370.0}},
    }
    assert best_ceiling(summary) == {"sweep_c1": "ceiling", "sweep_c64": "ceiling_alt"}
    assert summary["ceiling_defaults"]["sweep_c64"]["tok_s"] == 3800.0
    by_scen = {r["scenario"]: r for r in ratios(summary) if r["metric"] == "output tok/s"}
    assert by_scen["sweep_c1"]["mlxd_over_ceiling"] == pytest.approx(0.95)
    assert by_scen["sweep_c64"]["mlxd_over_ceiling"] == pytest.approx(0.95)
    one = {"ceiling": {"sweep_c1": {"tok_s": 1.0}}}
    assert best_ceiling(one) == {} and "ceiling_defaults" not in one
    # The graphs-off ceiling alone is the ceiling the ratios use.
    alt_only = {
        "ceiling_alt": {"sweep_c1": {"tok_s": 200.0}},
        "mlxd": {"sweep_c1": {"tok_s": 190.0}},
    }
    assert best_ceiling(alt_only) == {"sweep_c1": "ceiling_alt"}
    row = next(r for r in ratios(alt_only) if r["metric"] == "output tok/s")
    assert row["mlxd_over_ceiling"] == pytest.approx(0.95)


def test_run_with_both_ceilings_reports_each_and_the_choice(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ceilings"
    r = _bench(
        "run", "--preset", "test", "--model", str(tiny_model_dir), "--out", str(out),
        "--quiet", "--targets", "ceiling,ceiling_alt",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((out / "results.json").read_text())
    assert set(res["targets"]) == {"ceiling", "ceiling_alt"}
    assert res["targets"]["ceiling_alt"]["cuda_graphs_env"] == "0"  # mlxd's CUDA settings
    choice = res["ceiling_choice"]
    assert set(choice) == set(res["summary"]["ceiling_alt"]) and "sweep_c1" in choice
    for scen, pick in choice.items():
        want = max(
            res["summary"]["ceiling_defaults"][scen]["tok_s"],
            res["summary"]["ceiling_alt"][scen]["tok_s"],
        )
        assert res["summary"]["ceiling"][scen]["tok_s"] == want, (scen, pick)
    report = (out / "report.md").read_text()
    assert "## The ceiling at both settings" in report and "| sweep_c1 |" in report


def test_pass_probe_splits_each_pass_into_building_and_running(tiny_model_dir: Path) -> None:
    """The probe's numbers add up, and a pass over more tokens costs the device more."""
    from bench.pass_probe import probe

    res = probe(
        tiny_model_dir,
        reps=2,
        decode=((1, 64), (4, 64)),
        prompt=((8, 0), (512, 64)),
        join=((4, 64, 32),),
        engine=((8, 0), (300, 100)),
    )
    passes = {(p["kind"], p["rows"], p["tokens"], p["kv"]): p for p in res["passes"]}
    assert set(passes) == {
        ("decode", 1, 1, 64),
        ("decode", 4, 1, 64),
        ("prompt", 1, 8, 0),
        ("prompt", 1, 512, 64),
        ("engine", 1, 8, 0),
        ("engine", 1, 300, 100),
    }
    for p in passes.values():
        assert p["build_ms"] > 0 and p["device_ms"] >= 0 and p["first_ms"] > 0
        assert abs(p["build_ms"] + p["device_ms"] - p["total_ms"]) < 0.01
    assert passes[("prompt", 1, 512, 64)]["device_ms"] > passes[("prompt", 1, 8, 0)]["device_ms"]
    assert passes[("engine", 1, 300, 100)]["total_ms"] > passes[("engine", 1, 8, 0)]["total_ms"]
    assert [p["rows"] for p in res["pipelined"]] == [1, 4]
    assert all(p["step_ms"] > 0 for p in res["pipelined"])
    (join,) = res["join"]
    assert (join["rows"], join["kv"], join["tokens"]) == (4, 64, 32)
    assert 0 < join["join_ms"] < join["join_decode_ms"]  # the decode pass comes on top


def test_run_refuses_scenarios_the_preset_does_not_have(tiny_model_dir: Path) -> None:
    """A misspelt --scenarios is a clear error before anything starts, not an empty run."""
    r = _bench(
        "run",
        "--preset",
        "test",
        "--model",
        str(tiny_model_dir),
        "--scenarios",
        "sweep_c9,,",
        "--quiet",
        timeout=120,
    )
    assert r.returncode != 0
    assert "no scenario matches sweep_c9" in r.stderr and "sweep_c1" in r.stderr
    assert "Traceback" not in r.stderr


def test_mixed_pressure_steps_are_the_worker_steps_from_arrival_to_first_token() -> None:
    from bench.steps import mixed_pressure_steps, steps_table

    t0 = 1000.0
    results = {
        "targets": {
            "mlxd": {
                "scenarios": {
                    "mixed_pressure": {
                        "t0": t0,
                        "extra": {"arrival": 2.0, "long_id": "long"},
                        "waves": [{"requests": [{"id": "s0"}, {"id": "long", "first_token": 2.3}]}],
                    }
                }
            }
        }
    }

    def step(t: float, prompt: int = 0) -> dict[str, float | int | bool]:
        return {"t": t0 + t, "s": 0.01, "predicted_s": 0.01, "prompt_tokens": prompt, "chunk": 64}

    trace = [step(1.99), step(2.01), step(2.1, 64), step(2.3, 64), step(2.34), step(2.5)]
    rows = mixed_pressure_steps(results, trace)
    # From the arrival to its first token and 50 ms past it; periods from the step before.
    assert [r["at_ms"] for r in rows] == [10.0, 100.0, 300.0, 340.0]
    assert [r["period_ms"] for r in rows] == [20.0, 90.0, 200.0, 40.0]
    assert len(steps_table(rows)) == 2 + len(rows)
    assert mixed_pressure_steps({"targets": {}}, trace) == []


def test_launch_probe_times_every_kind_of_primitive(tmp_path: Path) -> None:
    """Every kind's chain is built and evaluated; the matmuls, which compute,
    cost more than nothing to evaluate; the command writes what it printed."""
    from bench import launch_probe

    result = launch_probe.probe(chain=20, reps=1)
    kinds = result["per_primitive"]
    assert set(kinds) == set(launch_probe._chains())
    assert all(k["build_us"] > 0 and k["eval_us"] >= 0 for k in kinds.values())
    assert kinds["matmul 64x64 (kernel)"]["eval_us"] > 0
    out = tmp_path / "launch.json"
    r = _bench("--chain", "10", "--reps", "1", "--out", str(out), module="bench.launch_probe")
    assert r.returncode == 0, r.stderr
    assert "a primitive" in r.stdout
    assert json.loads(out.read_text())["chain"] == 10


def test_variant_probe_alternates_the_step_variants_in_one_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every variant runs decode steps in every round and fused steps once
    prompts arrive; the ratios are against the first variant; the runner is
    left as the worker runs it (lean, joins on)."""
    out = tmp_path / "variants.json"
    r = _bench(
        "--model",
        str(tiny_model_dir),
        "--streams",
        "3",
        "--rounds",
        "6",
        "--prompt",
        "200",
        "--chunk",
        "64",
        "--out",
        str(out),
        module="bench.variant_probe",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["joined"] > 0 and result["arrivals"] >= 2
    decode, fused = result["summary"]["decode"], result["summary"]["fused"]
    assert (
        set(decode)
        == set(fused)
        == {
            "base",
            "lean",
            "joined",
            "rope",
            "nodes",
            "buffers",
            "rotary",
            "attention",
        }
    )
    assert result["decode_attention"] is False and result["decode_rotary"] is False  # no CUDA
    assert all(row["steps"] >= 5 for row in decode.values())
    assert decode["base"]["ratio_to_base"] == 1.0
    assert all(row["median_ms"] > 0 for row in fused.values())
    # fused steps are matched by their place in the prompt, not by round
    assert fused["base"]["ratio_to_base"] == 1.0
    assert all(row["matched_places"] >= 1 for row in fused.values()), fused


def test_variant_probe_matches_fused_steps_by_their_place_in_the_prompt() -> None:
    """A later chunk costs more (its KV is longer): a variant 10% cheaper at
    every place reads 0.9, whichever places each happened to run most."""
    from bench.variant_probe import _summary

    cost = {0: 10.0, 1: 20.0, 2: 40.0}
    by_place = {
        "a": {0: [cost[0]] * 5, 1: [cost[1]], 2: [cost[2]]},
        "b": {0: [0.9 * cost[0]], 1: [0.9 * cost[1]], 2: [0.9 * cost[2]] * 5},
    }
    times = {
        "decode": {},
        "fused": {v: [x for xs in p.values() for x in xs] for v, p in by_place.items()},
    }
    fused = _summary(times, [], by_place, ["a", "b"])["fused"]
    assert fused["b"]["ratio_to_a"] == 0.9 and fused["b"]["matched_places"] == 3
    assert fused["b"]["median_ms"] > fused["a"]["median_ms"]  # the raw medians mislead


def test_variant_probe_sets_the_step_it_names(tiny_model_dir: Path) -> None:
    import worker.decode_rotary as decode_rotary
    import worker.fused as fused
    import worker.joined as joined
    import worker.prompt_attention as prompt_attention
    from bench.variant_probe import _apply
    from worker.runner import Runner

    runner = Runner(tiny_model_dir, fused=True)
    try:
        for variant, lean, suspended, apart, off, buffers, rotary, grouped in (
            ("base", False, True, False, True, False, False, False),
            ("lean", True, True, False, True, False, False, False),
            ("joined", True, False, True, True, False, False, False),
            ("rope", True, False, False, True, False, False, False),
            ("nodes", True, False, False, False, False, False, False),
            ("buffers", True, False, False, False, True, False, False),
            ("rotary", True, False, False, False, True, True, False),
            ("attention", True, False, False, False, True, False, True),
        ):
            with _apply(runner, variant):
                assert runner.generator.lean is lean
                assert joined._suspended is suspended
                assert joined._separate_rope is apart
                assert joined.plain_pass is off
                assert fused.buffer_decode is buffers
                assert decode_rotary.suspended is not rotary
                assert prompt_attention.enabled is grouped
            assert joined._suspended is False and joined._separate_rope is False
            assert joined.plain_pass is False and fused.buffer_decode is True
            assert decode_rotary.suspended is False and prompt_attention.enabled is False
    finally:
        runner.close()


def test_cost_replay_reproduces_the_workers_own_predictions(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """bench.cost_replay feeds a step trace to a fresh Scheduler as the engine
    did: its `base` predictions for the paced steps are the worker's own (the
    trace's `predicted_s`) to within the refit's timing, so a variant's
    numbers price a change to what the model learns, not the replay's error.
    `base` is the worker's rule without `admission_cost` (on by default since
    session 32: `admit-term`), so the worker here runs without it. The
    worker refits its model when it plans a step and the replay when it
    asks, so the two differ by a refit's timing: over 12 runs of 800-token
    prompts (43-50 paced steps) the median difference was at most 0.017,
    while 400-token prompts (about 5 paced steps) reached 0.025 once in six."""
    trace = tmp_path / "trace"
    args = ("--prompt", "800", "--calibrate-s", "0.2", "--calibrated-only", "--fused", "off")
    args += ("--admission-cost", "off")
    r = _bench(
        "--model", str(tiny_model_dir), *args, "--trace", str(trace),
        "--out", str(tmp_path / "probe.json"), module="bench.pacing_probe",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ((_, steps),) = list(cost_replay.read_traces(trace))
    base = cost_replay.replay(steps, "base")
    assert len(base.pairs) >= 5 and not base.approximate
    fidelity = base.fidelity()
    assert fidelity is not None and fidelity < 0.03, fidelity
    # the same trace from a tarball, as the GPU jobs keep them
    with tarfile.open(tmp_path / "mlxd-steps.tar.xz", "w:xz") as tar:
        tar.add(trace, arcname="mlxd-steps")
    ((_, packed),) = list(cost_replay.read_traces(tmp_path / "mlxd-steps.tar.xz"))
    assert packed == steps
    # `no-admit` learns less: the paced step that admitted the prompt is left out
    assert any(s["admitted"] and s["decoding"] and s["prompt_tokens"] for s in steps)
    assert cost_replay.replay(steps, "no-admit").pairs != base.pairs
    with pytest.raises(ValueError, match="unknown variant"):
        cost_replay.replay(steps, "nope")
    out = tmp_path / "replay.json"
    r = _bench(str(trace), "--variants", "base", "--json", str(out), module="bench.cost_replay")
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())
    assert row["variant"] == "base" and row["paced_steps"] == len(base.pairs)
    # the worker as it runs by default (admission_cost on): `admit-term` is its rule
    on_trace = tmp_path / "trace-on"
    r = _bench(
        "--model", str(tiny_model_dir), *args[:-2], "--trace", str(on_trace),
        "--out", str(tmp_path / "probe-on.json"), module="bench.pacing_probe",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ((_, on_steps),) = list(cost_replay.read_traces(on_trace))
    term = cost_replay.replay(on_steps, "admit-term").fidelity()
    assert term is not None and term < 0.03, term


def test_min_waves_and_min_wave_requests_raise_every_sweep_levels_waves(
    tiny_model_dir: Path,
) -> None:
    from bench.run import RunConfig, prepare_workload

    def waves(**kw: int) -> dict[str, int]:
        wl = prepare_workload(RunConfig(preset="standard", **kw), tiny_model_dir)
        return {s.name: len(s.waves()) for s in wl.scenarios if s.name.startswith("sweep_")}

    assert waves() == {
        f"sweep_c{c}": n for c, n in ((1, 32), (4, 8), (8, 4), (16, 3), (32, 3), (64, 3))
    }
    more = waves(min_waves=16, min_wave_requests=80)
    assert more["sweep_c1"] == 80 and more["sweep_c4"] == 20 and more["sweep_c32"] == 16


def test_cost_replay_admit_term_prices_what_an_admission_adds() -> None:
    """A synthetic trace whose paced steps cost 5 ms + 20 µs a prompt token
    beside 4 decoding rows (a 4 ms decode step), and whose admitting steps pay
    6 ms more per request admitted: `base` underprices the admitting steps,
    `no-admit+admit-term` prices them within a few percent."""
    steps: list[dict[str, Any]] = []
    for i in range(120):
        steps.append({"s": 0.004, "decoding": 4, "prompt_tokens": 0, "chunk": 64, "pass_tokens": 0,
                      "kv": 0, "pass_chunk": 0, "admitted": 0, "learned": True})  # fmt: skip
        tokens = (64, 128, 256, 512)[i % 4]
        admitted = 1 if i % 3 == 0 else 0
        steps.append({"s": 0.005 + 20e-6 * tokens + 0.006 * admitted, "decoding": 4,
                      "prompt_tokens": tokens, "chunk": tokens, "pass_tokens": tokens,
                      "kv": 256 * (i % 5), "pass_chunk": tokens, "admitted": admitted,
                      "learned": True})  # fmt: skip
    base = cost_replay.replay(steps, "base").summary()
    term = cost_replay.replay(steps, "admit-term").summary()
    assert base["admitting_steps"] > 30 and term["admitting_steps"] > 30
    assert base["admitting_predicted_over_took_p50"] < 0.9
    assert 0.97 <= term["admitting_predicted_over_took_p50"] <= 1.03
    assert term["admitting_abs_log_error_mean"] < base["admitting_abs_log_error_mean"] / 3
    assert term["abs_log_error_mean"] < base["abs_log_error_mean"]
    # every pass here runs beside decode rows; the model is ready at two sizes,
    # and `admit-term` does not learn the admitting steps as passes
    assert base["beside_passes_first"] == 2 and base["beside_passes_min"] == 2
    assert cost_replay.replay(steps, "admit-term").beside[-1] < cost_replay.replay(steps).beside[-1]


def test_cost_replay_lag_learns_what_the_next_step_pays() -> None:
    """A synthetic pipelined trace: blocks of ten 4 ms decode steps, then four
    paced steps whose passes cost 2 ms + 20 µs a prompt token, each landing in
    the next step's duration (every step also takes 4 ms of its own). The
    worker's rule, taught each step's own duration, misprices the paced
    steps; `lag`, taught with the next step's, prices what they cause."""
    steps: list[dict[str, Any]] = []
    pending = 0.0
    orders = ((64, 128, 256, 512), (512, 256, 128, 64), (128, 512, 64, 256))
    for block in range(60):
        for _ in range(10):
            steps.append({"s": 0.004 + pending, "decoding": 4, "prompt_tokens": 0, "chunk": 64,
                          "pass_tokens": 0, "kv": 0, "pass_chunk": 0, "admitted": 0,
                          "learned": True})  # fmt: skip
            pending = 0.0
        for tokens in orders[block % 3]:
            steps.append({"s": 0.004 + pending, "decoding": 4, "prompt_tokens": tokens,
                          "chunk": tokens, "pass_tokens": tokens, "kv": 0, "pass_chunk": tokens,
                          "admitted": 0, "learned": True})  # fmt: skip
            pending = 0.002 + 20e-6 * tokens
    own = cost_replay.replay(steps, "admit-term").summary()
    later = cost_replay.replay(steps, "admit-term@next").summary()
    lag = cost_replay.replay(steps, "lag").summary()
    assert own["paced_steps"] > 200 and lag["paced_steps"] > 200
    assert lag["abs_log_error_mean"] < 0.05 < later["abs_log_error_mean"]
    assert lag["within_20pct"] == 1.0 and own["within_20pct"] < 0.6


def test_alloc_probe_times_every_growth_three_ways(tmp_path: Path) -> None:
    out = tmp_path / "alloc.json"
    r = _bench("--shape", "tiny", "--rows", "2", "--host-arrays", "--out", str(out),
               module="bench.alloc_probe")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    growths = (alloc_probe.END - alloc_probe.START) // alloc_probe.STEP
    for case in ("fresh", "cached", "after_clear"):
        assert len(result[case]) == growths and all(t > 0 for t in result[case])
    # no CUDA driver on this machine: the pool is left alone, and says so
    assert result["keep_freed"] is False and "pool keeps freed memory: False" in r.stdout
    arrays = result["host_arrays"]
    assert len(arrays["queued_ms"]) == 3 and all(t > 0 for t in arrays["queued_ms"])
    for n in (16, 256, 2048):
        assert len(arrays[f"fresh/{n}"]) == len(arrays[f"after_device/{n}"]) == 8


def test_admit_probe_times_the_admitting_steps_stages(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each pass admits every prompt once, uncached, beside decoding streams; the
    `phases` pass times the fused generator's stages with the device waited for,
    and only that pass has them."""
    out = tmp_path / "admit.json"
    r = _bench(
        "--model", str(tiny_model_dir), "--streams", "3", "--prompts", "40,90", "--reps", "2",
        "--fused-step", "on", "--chunk", "32", "--out", str(out),
        module="bench.admit_probe",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["fused"] is True
    for pass_name in ("default", "phases", "no_reserve"):
        for length in (40, 90):
            entry = result[f"{pass_name}/{length}"]
            for rep in entry["reps"]:
                # all of the prompt is prefilled: nothing came from the prefix cache
                assert sum(s["prompt_tokens"] for s in rep["steps"]) == length
            admitting = entry["summary"]["admitting"]
            assert admitting["ms"] > 0
            staged = admitting["_fused"] is not None
            assert staged == (pass_name == "phases")
    phases = result["phases/90"]["summary"]["admitting"]
    assert 0 < phases["_fused"] <= phases["ms"]
    assert phases["_admit"] > 0 and phases["_cut_chunks"] > 0
    # the prompt joins the decode rows in its last chunk's step, the join timed
    # and evaluated there (its own stage), in that step only
    for rep in result["phases/90"]["reps"]:
        joined = [s for s in rep["steps"] if "_join" in s]
        assert [s["prompt_tokens"] for s in joined] == [26]
        assert joined[0]["_started"] > 0 and 0 < joined[0]["_join"] < joined[0]["ms"]
    assert all("_join" not in s for s in result["default/90"]["reps"][0]["steps"])
    # --chunk: every step of a prompt carries that many tokens, the admitting one
    # too, so there are steps of its size without an admission to compare with
    for rep in result["default/90"]["reps"]:
        paced = [s["prompt_tokens"] for s in rep["steps"] if s["prompt_tokens"]]
        assert paced == [32, 32, 26]
    assert result["default/90"]["summary"]["later"]["ms"] > 0
    # every pass ran (`--passes` left out), and the phases and host passes time
    # every step's parts, the joining step's too; only the host pass sums waits
    assert {k.split("/")[0] for k in result if "/" in k} == set(admit_probe.PASSES)
    for pass_name in ("phases", "host"):
        summary = result[f"{pass_name}/90"]["summary"]
        assert 0 < summary["joining"]["_pass"] <= summary["joining"]["_runner"]
        assert summary["admitting"]["_fused"] > 0
        assert (summary["admitting"]["_wait"] is not None) == (pass_name == "host")
    assert "_join" in result["host/90"]["reps"][0]["steps"][2]
    # each step's memory: the admitting step's pass allocates above what was live
    assert result["default/90"]["summary"]["admitting"]["peak_mib"] > 0


def test_build_probe_times_a_decode_pass_and_counts_its_primitives(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The decode rows' pass built apart from its evaluation: a build time, and
    the pass's primitives, the joined projections' parts one Split each."""
    out = tmp_path / "build.json"
    r = _bench(
        "--model", str(tiny_model_dir), "--streams", "3", "--reps", "5", "--out", str(out),
        module="bench.build_probe",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["decoding"] == 3 and result["layers"] == 2
    assert result["build_ms_median"] > 0 and result["build_ms_mean"] > 0
    assert result["before_build_ms_median"] > 0
    kinds = result["by_kind"]
    assert result["primitives"] == sum(kinds.values()) and kinds["Matmul"] > 0
    # the transposes (the weights', 4 a layer and the vocabulary's; the
    # heads', 3 a layer) and the residuals' Adds gone, the residuals in
    # AddMMs (worker/blocks.py)
    before, layers = result["before_by_kind"], result["layers"]
    assert before["Transpose"] - kinds["Transpose"] == 7 * layers + 1
    assert kinds["AddMM"] == 2 * layers and "AddMM" not in before
    # and (session 40, counted with the caches' new state) the decode rows'
    # offsets made once a pass, not once a layer: an Add and its Broadcast
    # each layer but one (worker/fused.py, `next_offsets`)
    fewer = 9 * layers + 1 + 2 * (layers - 1)
    assert result["before_primitives"] - result["primitives"] == fewer
    # q and k rotated as one, then split, and the MLP's gate and up: a Split
    # each a layer where slices were
    assert kinds.get("Split", 0) >= 2 * result["layers"]


def test_a_shape_model_is_made_in_a_child_process_and_then_reused(tmp_path: Path) -> None:
    """The bench process that makes a shape's weights holds none of them after
    (on a GPU they stayed in its MLX cache beside the server it measured:
    session 42's 8B run ran mlxd's worker out of device memory), and the
    second call reuses the model it made."""
    code = (
        "import sys; from pathlib import Path; from bench.models import shape_model; "
        f"p = shape_model('tiny', cache_dir=Path({str(tmp_path)!r})); "
        "print(p, 'mlx.core' in sys.modules)"
    )
    root = Path(__file__).resolve().parent.parent
    first = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    path, imported = first.stdout.split()
    assert imported == "False" and (Path(path) / "config.json").is_file()
    made = (Path(path) / "config.json").stat().st_mtime_ns
    assert models.shape_model("tiny", cache_dir=tmp_path) == Path(path)
    assert (Path(path) / "config.json").stat().st_mtime_ns == made
