"""`bench run`: one reproducible run against the ceiling, the engine, mlxd and the peer.

Owns the order of a run and its output directory:
1. resolve the model (a directory, a named random shape, or the tiny default)
   and build the seeded workload from its chat template;
2. the ceiling (BatchGenerator in a child process), the engine (mlxd's
   EngineCore over Runner in a child process), then mlxd (started here on a
   loopback port, or a running one at --url), then the peer (mlx_lm.server
   started here), one at a time so they never compete for the machine;
3. derive the metrics, write `results.json` (after every target, so a crash
   keeps what was measured), `report.md` and PNG plots when matplotlib exists.
A target that fails to start or run is recorded under "skipped" and the run
goes on; the exit status is then 1.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import analysis, ceiling, interleave, models, peer, servers, steps
from bench.client import Target
from bench.plots import write_plots
from bench.progress import Progress
from bench.report import markdown
from bench.scenarios import TargetRunner
from bench.workload import PAIRED_KINDS, PRESETS, Workload, build_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ALL_TARGETS = ("ceiling", "ceiling_alt", "engine", "mlxd", "peer")
# The ceiling again at mlxd's CUDA settings (graphs and cuDNN attention off,
# worker/backend.py): on CUDA neither setting is best everywhere, and mlxd is
# measured against the better one per scenario (issue #12 item 8). CPU and
# Metal ignore both variables, so there it is a second run of the same ceiling.
ALT_CEILING_ENV = {"MLX_USE_CUDA_GRAPHS": "0", "MLX_CUDA_USE_CUDNN_SDPA": "0"}
# Driven in-process (bench/ceiling.py) rather than over HTTP.
IN_PROCESS = ("ceiling", "ceiling_alt", "engine")


def default_targets() -> tuple[str, ...]:
    """Every target; the alternate ceiling only where CUDA settings can differ."""
    cuda = bool(models.machine_facts().get("gpus"))
    return tuple(t for t in ALL_TARGETS if t != "ceiling_alt" or cuda)


@dataclass(slots=True)
class RunConfig:
    preset: str = "smoke"
    model: Path | None = None
    shape: str | None = None
    url: str | None = None
    out: Path | None = None
    targets: tuple[str, ...] = ("ceiling", "engine", "mlxd", "peer")
    seed: int = 0
    eos: str = "auto"  # auto | suppress | keep
    quiet: bool = False
    argv: list[str] = field(default_factory=list)
    # MLXD_* settings for the mlxd it starts, e.g. {"MLXD_GROUP_SIZE": "2"} for a
    # sharded worker group; recorded in the results with the server's command.
    mlxd_env: dict[str, str] = field(default_factory=dict)
    # Every target at once, each paired scenario's waves alternated between them
    # (bench/interleave.py), instead of one target after another.
    interleave: bool = False
    # Only these scenarios (names or kinds); () runs the whole preset.
    scenarios: tuple[str, ...] = ()
    # Interleaved only: seconds after the start past which no wave or scenario
    # starts; what ran is written (a lent GPU's session ends on the dot).
    deadline_s: float | None = None
    # mlxd's worker writes its step trace into <out>/mlxd-steps (bench/steps.py).
    step_trace: bool = False
    # Each sweep level runs at least this many waves, and at least this many
    # requests (0: the preset's), for a ratio spread the preset's waves do not
    # reach (the report's "waves for +-0.03" says how many).
    min_waves: int = 0
    min_wave_requests: int = 0


def default_out(preset: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return RESULTS_DIR / f"{stamp}-{preset}"


def resolve_model(cfg: RunConfig) -> tuple[Path, str | None]:
    if cfg.model is not None and str(cfg.model) == "default":
        from worker.modelfiles.default_model import ensure_default_model

        return ensure_default_model(), None  # the embedded SmolLM2-135M
    if cfg.model is not None:
        return cfg.model.resolve(), None
    if cfg.url is not None:
        _, body = servers.http_get(cfg.url.rstrip("/") + "/ready")
        name = body.get("model") if isinstance(body, dict) else None
        _, info = servers.http_get(f"{cfg.url.rstrip('/')}/models/{name}/status")
        path = info.get("path") if isinstance(info, dict) else None
        if not path or not Path(path).is_dir():
            raise SystemExit(f"bench: cannot find the model directory of {cfg.url}; pass --model")
        return Path(path), None
    shape = cfg.shape or "tiny"
    return models.shape_model(shape), shape


def mlxd_target(url: str, model: str, wl: Workload) -> Target:
    """mlxd as a bench target: token ids per event, worker stats from its status route."""
    return Target(
        "mlxd",
        url,
        model,
        token_ids=True,
        suppress_eos=wl.suppress_eos,
        status_path=f"/models/{model}/status",
    )


def prepare_workload(cfg: RunConfig, model_dir: Path) -> Workload:
    return prepare(cfg, model_dir)[0]


def prepare(cfg: RunConfig, model_dir: Path) -> tuple[Workload, models.Tokenizer]:
    tok = models.Tokenizer(model_dir)
    random_weights = models.is_random_model(model_dir)
    if cfg.eos == "suppress" or (cfg.eos == "auto" and not random_weights):
        suppress = tok.eos_token_ids
    else:
        suppress = []
    preset = PRESETS[cfg.preset]
    preset = replace(
        preset,
        waves=max(preset.waves, cfg.min_waves),
        min_wave_requests=max(preset.min_wave_requests, cfg.min_wave_requests),
    )
    wl = build_workload(
        preset,
        tok.render,
        seed=cfg.seed,
        suppress_eos=suppress,
        canned_replies=random_weights,
    )
    _check_context(wl, model_dir)
    if cfg.scenarios:
        wl = wl.select(cfg.scenarios)
    return wl, tok


def _check_context(wl: Workload, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    ctx = int(config.get("max_position_embeddings") or 4096)
    p = wl.preset
    need = max(
        p.long_prompt_tokens + p.long_max_tokens,
        p.prefix_history_tokens + p.prefix_turns * (64 + p.prefix_turn_tokens),
        p.prompt_tokens[1]
        + max(
            p.max_tokens * 8,
            p.sustained_tokens,
            p.mixed_tokens,
            max(p.sustained_tokens, p.mixed_tokens) * 4,
        ),
    )
    if need > ctx:
        raise SystemExit(
            f"bench: the {p.name} preset needs {need} tokens of context; the model has {ctx}"
        )


def openblas_env() -> dict[str, str]:
    """The preload mlxd's supervisor gives its worker, for the ceiling and the peer too."""
    import os

    from protocol.worker_config import openblas_preload_path

    path = openblas_preload_path()
    return {"LD_PRELOAD": path} if path and "LD_PRELOAD" not in os.environ else {}


def run(cfg: RunConfig) -> int:
    deadline = None if cfg.deadline_s is None else time.monotonic() + cfg.deadline_s
    model_dir, shape = resolve_model(cfg)
    out = (cfg.out or default_out(cfg.preset)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    wl, tok = prepare(cfg, model_dir)
    max_batch = wl.max_concurrency()
    servers_run = sum(1 for t in ("mlxd", "peer") if t in cfg.targets)
    if cfg.interleave:  # starts, paired scenarios, then the servers' own scenarios
        paired = sum(1 for s in wl.scenarios if s.kind in PAIRED_KINDS)
        steps = len(cfg.targets) + paired + servers_run * (len(wl.scenarios) - paired)
    else:
        steps = sum(1 for t in IN_PROCESS if t in cfg.targets)
        steps += servers_run * (len(wl.scenarios) + 1)
    progress = Progress(steps, enabled=not cfg.quiet)
    progress.note(
        f"bench: preset {cfg.preset}, model {model_dir}, workload {wl.digest()}, output {out}"
    )
    results: dict[str, Any] = {
        "schema": "mlxd-bench/1",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench " + shlex.join(cfg.argv),
        "model": {**models.model_facts(model_dir, shape), "special_tokens": tok.special_tokens},
        "versions": models.versions(),
        "machine": models.machine_facts(),
        "workload": wl.describe(),
        "targets": {},
        "skipped": {},
    }
    if moved := _set_aside(out, results):
        progress.note(f"bench: {out / 'results.json'} was another workload's: kept as {moved}")
    kept = _earlier_targets(out, results, cfg.targets)
    if kept:
        results["targets"].update(kept)
        results["command"] += f" (merged with earlier runs of {', '.join(sorted(kept))})"
        progress.note(f"bench: keeping {', '.join(sorted(kept))} from {out / 'results.json'}")
    share = memory_share(cfg) if cfg.interleave else None
    targets = _Targets(cfg, wl, model_dir, out, max_batch, openblas_env(), share)
    for name in ALL_TARGETS:
        if name not in cfg.targets and name not in results["targets"]:
            results["skipped"][name] = "not selected"
    if cfg.interleave:
        names = [n for n in ALL_TARGETS if n in cfg.targets]
        data, skipped, order = asyncio.run(
            interleave.run_interleaved(
                names,
                wl,
                IN_PROCESS,
                targets.start_child,
                targets.start_server,
                progress,
                deadline,
                out / "waves.jsonl",
            )
        )
        results["targets"].update(data)
        results["skipped"].update(skipped)
        results["interleave"] = {**order, "memory_share_bytes": share}
        failed = bool(skipped)
        _write(out, results)
    else:
        failed = False
        for name in ALL_TARGETS:
            if name not in cfg.targets:
                continue
            try:
                results["targets"][name] = _run_target(name, targets, progress)
            except Exception as e:  # one target failing must not lose the others
                failed = True
                results["skipped"][name] = f"failed: {type(e).__name__}: {e}"
                (out / f"{name}-error.txt").write_text(traceback.format_exc())
                progress.note(f"bench: {name} failed: {e}")
            _write(out, results)
    finish(results, out)
    progress.note(f"bench: wrote {out / 'report.md'} and {out / 'results.json'}")
    headline(results, sys.stdout)
    return 1 if failed else 0


def _same_run(old: dict[str, Any], results: dict[str, Any]) -> bool:
    """Whether `old` results are of the same workload and model as `results`."""
    return (old.get("workload") or {}).get("digest") == results["workload"]["digest"] and (
        old.get("model") or {}
    ).get("identity") == results["model"]["identity"]


def _set_aside(out: Path, results: dict[str, Any]) -> str | None:
    """Rename an earlier results.json (and its report.md) of another workload or
    model in `out`, which this run would otherwise overwrite, to
    results-<its creation time>.json; the new name, or None. (Session 18: the
    peer's two levels run into the directory of an interleaved preset, a
    different scenario list and so another workload, replaced its results.)"""
    try:
        old = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return None
    if _same_run(old, results):
        return None
    stamp = "".join(c for c in str(old.get("created") or "earlier") if c.isalnum())
    for name in ("results.json", "report.md"):
        if (out / name).exists():
            stem, _, ext = name.partition(".")
            (out / name).replace(out / f"{stem}-{stamp}.{ext}")
    return f"results-{stamp}.json"


def _earlier_targets(
    out: Path, results: dict[str, Any], running: tuple[str, ...]
) -> dict[str, Any]:
    """Targets an earlier run wrote to this directory with the same workload and model.

    A preset too long for one command (a 10-minute limit, say) can then be run one
    target per command into one directory; the report covers them all.
    """
    try:
        old = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    if not _same_run(old, results):
        return {}
    return {k: v for k, v in (old.get("targets") or {}).items() if k not in running}


def memory_share(cfg: RunConfig, gpus: list[str] | None = None) -> int | None:
    """Each target's share of the GPU when every target is alive at once (an
    interleaved run on an NVIDIA machine): 90% of the smallest GPU's memory over
    the targets; None elsewhere (CPU, Metal: the run's targets share RAM, and no
    worker caps MLX there).

    Each target is held to it: MLX's memory limit in the in-process targets and
    the peer (bench/mlx_capped.py), mlxd's and the engine's memory budget, which
    is their MLX limit on CUDA (worker/backend.py). Without it (session 12,
    llama8b) every process kept its freed buffers, up to 95% of the device each,
    and the ceilings, the engine and mlxd's worker died of cudaMallocAsync.
    """
    total = models.gpu_memory_bytes(gpus)
    if total is None or not cfg.targets:
        return None
    return int(0.9 * total / len(cfg.targets))


@dataclass(frozen=True, slots=True)
class _Targets:
    """How this run starts each target: one place for both orders."""

    cfg: RunConfig
    wl: Workload
    model_dir: Path
    out: Path
    max_batch: int
    env: dict[str, str]
    memory_share: int | None = None  # memory_share(): each target's part of the GPU

    def spec(self, name: str) -> dict[str, Any]:
        spec = ceiling.spec_for(
            self.wl, self.model_dir, self.max_batch, driver=ceiling.DRIVERS[name]
        )
        return {**spec, "memory_limit_bytes": self.memory_share}

    def child_env(self, name: str) -> dict[str, str]:
        return {**self.env, **ALT_CEILING_ENV} if name == "ceiling_alt" else self.env

    async def start_child(self, name: str) -> ceiling.WaveProcess:
        return await ceiling.WaveProcess.start(
            self.spec(name), self.out, self.child_env(name), name
        )

    def mlxd_env(self) -> dict[str, str]:
        """--mlxd-env's settings, and the GPU share as mlxd's memory budget unless
        they set one."""
        env = dict(self.cfg.mlxd_env)
        if self.cfg.step_trace:
            env.setdefault(steps.STEP_TRACE_ENV, str((self.out / steps.STEPS_DIR).resolve()))
        if self.memory_share is None:
            return env
        return {"MLXD_MEMORY_BUDGET_BYTES": str(self.memory_share), **env}

    def start_server(self, name: str) -> tuple[servers.ServerProcess, Target]:
        """mlxd (started here, or the running one at --url) or the peer, and its client target."""
        cfg, wl = self.cfg, self.wl
        if name == "mlxd":
            server = (
                servers.attach_mlxd(cfg.url)
                if cfg.url
                else servers.start_mlxd(
                    self.model_dir, self.out, max_batch=self.max_batch, env_extra=self.mlxd_env()
                )
            )
            return server, mlxd_target(server.url, server.model, wl)
        server = peer.start_peer(
            self.model_dir,
            self.out,
            max_batch=self.max_batch,
            env_extra=self.env,
            memory_limit_bytes=self.memory_share,
        )
        return server, Target(
            "peer", server.url, server.model, token_ids=False, suppress_eos=wl.suppress_eos
        )


def _run_target(name: str, targets: _Targets, progress: Progress) -> dict[str, Any]:
    """One target alone on the machine (plain `bench run`)."""
    if name in IN_PROCESS:
        what = "EngineCore over Runner" if name == "engine" else "BatchGenerator"
        progress.begin(f"{name} ({what} in-process)", 1)
        data = ceiling.run_subprocess(
            targets.spec(name), targets.out, targets.child_env(name), name=name
        )
        progress.end()
        return data
    progress.begin(f"{name}: starting", 1)
    server, target = targets.start_server(name)
    progress.end(f"{server.startup_s:.1f}s" if server.startup_s else "attached")
    try:
        data = asyncio.run(TargetRunner(target, server, targets.wl, progress).run())
    finally:
        code = servers.stop(server)
    data["server"] = {**server.describe(), "exit_code": code}
    return data


def finish(results: dict[str, Any], out: Path) -> None:
    """Derive summary, ratios, checks and parity; write results.json, report.md, plots."""
    targets = results.get("targets") or {}
    summary = {name: analysis.summarize_target(name, data) for name, data in targets.items()}
    # The ceiling the ratios use: per scenario, the faster of the two settings.
    results["ceiling_choice"] = analysis.best_ceiling(summary)
    timelines = {}
    for name, scen in summary.items():
        mixed = scen.get("mixed_pressure")
        if mixed and "timeline" in mixed:
            timelines[name] = {
                "timeline": mixed.pop("timeline"),
                "arrival_s": mixed.get("arrival_s"),
                "long_first_token_s": mixed.get("long_first_token_s"),
            }
    results["summary"] = summary
    results["ratios"] = analysis.ratios(summary, paired=analysis.paired_run(results))
    results["parity"] = analysis.parity(results)
    results["checks"] = analysis.checks(results, summary)
    before = ((targets.get("mlxd") or {}).get("memory") or {}).get("before") or {}
    local = targets.get("ceiling") or targets.get("engine") or {}
    results["backend"] = before.get("backend") or local.get("backend")
    results["blas"] = before.get("blas") or local.get("blas")
    if (out / steps.STEPS_DIR).is_dir():
        trace = steps.load_steps(out / steps.STEPS_DIR)
        results["mlxd_steps"] = {"mixed_pressure": steps.mixed_pressure_steps(results, trace)}
    results["plots"] = write_plots(summary, timelines, out)
    _write(out, results)
    (out / "report.md").write_text(markdown(results))


def _write(out: Path, results: dict[str, Any]) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out / "results.json")


def headline(results: dict[str, Any], stream: Any) -> None:
    """A few lines for the terminal: the sweep throughput ratios and the checks."""
    rows = [
        r
        for r in results.get("ratios") or []
        if r["scenario"].startswith("sweep_") and r["metric"] == "output tok/s"
    ]
    for r in rows:
        # .get: results written before the engine target have no engine keys.
        stream.write(
            f"{r['scenario']:>12}: ceiling {_n(r['ceiling'])}, engine {_n(r.get('engine'))}, "
            f"mlxd {_n(r['mlxd'])}, peer {_n(r['peer'])} tok/s; engine/ceiling "
            f"{_n(r.get('engine_over_ceiling'), 3)}, mlxd/engine "
            f"{_n(r.get('mlxd_over_engine'), 3)}, mlxd/ceiling "
            f"{_n(r['mlxd_over_ceiling'], 3)}, mlxd/peer {_n(r['mlxd_over_peer'], 3)}\n"
        )
    for c in results.get("checks") or []:
        verdict = "n/a" if c["pass"] is None else ("PASS" if c["pass"] else "FAIL")
        stream.write(f"  [{verdict}] {c['check']}: {_n(c['value'], 3)} ({c['limit']})\n")
    stream.flush()


def _n(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
