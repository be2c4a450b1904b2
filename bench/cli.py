"""The benchmark's command line: `python -m bench {run,compare,trace}`.

`main(argv) -> int` is the entry point (`mlxd bench ...` can delegate to it).
Exit status: 0 success; 1 a target failed (run), a regression or a token
parity failure (compare); 2 bad usage or workloads that cannot be compared.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from urllib.parse import urlsplit

from bench.models import SHAPES
from bench.workload import PRESETS


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--model",
        type=Path,
        help="model directory, or 'default' for the embedded SmolLM2-135M (default: a tiny "
        "random model)",
    )
    g.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="a random-weight model of this shape, created once under "
        "bench/results/models (bf16 for qwen0.5b and llama8b)",
    )
    p.add_argument(
        "--url",
        help="a running mlxd (loopback) instead of starting one; the model "
        "directory is read from its status unless --model is given",
    )
    p.add_argument(
        "--out", type=Path, help="output directory (default bench/results/<time>-<preset>)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _mlxd_env_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mlxd-env",
        action="append",
        default=[],
        metavar="MLXD_KEY=VALUE",
        help="a setting for the mlxd it starts (repeatable), e.g. MLXD_GROUP_SIZE=2 to "
        "measure a sharded worker group against the single worker",
    )


def _mlxd_env(pairs: list[str]) -> dict[str, str] | None:
    """--mlxd-env's settings; None (after saying why) when one is not MLXD_KEY=VALUE."""
    env = dict(kv.split("=", 1) for kv in pairs if "=" in kv)
    if any(not k.startswith("MLXD_") for k in env) or len(env) != len(pairs):
        print("bench: --mlxd-env takes MLXD_KEY=VALUE", file=sys.stderr)
        return None
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="mlxd load benchmark against the BatchGenerator ceiling, mlxd's own "
        "engine in-process and mlx_lm.server",
    )
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="replay the seeded workload; write results.json, report.md")
    r.add_argument("--preset", choices=list(PRESETS), default="smoke")
    _model_args(r)
    r.add_argument(
        "--targets",
        default="",
        help="comma-separated subset of ceiling,ceiling_alt,engine,mlxd,peer (default: "
        "ceiling,engine,mlxd,peer, and ceiling_alt on a machine with NVIDIA GPUs)",
    )
    _mlxd_env_arg(r)
    r.add_argument(
        "--interleave",
        action="store_true",
        help="start every target at once and run each wave of the sweep, long-prefill and "
        "sustained scenarios on all of them back to back (order rotated per wave), so ratios "
        "pair waves seconds apart rather than targets minutes apart",
    )
    r.add_argument(
        "--step-trace",
        action="store_true",
        help="mlxd's worker writes one JSON line per engine step into OUT/mlxd-steps; the "
        "report then shows its steps under mixed pressure (bench/steps.py)",
    )
    r.add_argument(
        "--deadline-s",
        type=float,
        metavar="SECONDS",
        help="with --interleave: start no wave or scenario once this many seconds have "
        "passed since the start; what ran is written and reported, what was cut listed "
        "(for a machine lent until a fixed time)",
    )
    r.add_argument(
        "--min-waves",
        type=int,
        default=0,
        metavar="N",
        help="every sweep level runs at least N waves (default: the preset's), for the "
        "spread the report's 'waves for +-0.03' asks",
    )
    r.add_argument(
        "--min-wave-requests",
        type=int,
        default=0,
        metavar="N",
        help="every sweep level runs at least N requests, in more waves at low "
        "concurrency (default: the preset's)",
    )
    r.add_argument(
        "--scenarios",
        default="",
        help="comma-separated scenario names or kinds to run (default: the whole preset), "
        "e.g. sweep_c64,mixed_pressure",
    )
    r.add_argument(
        "--eos",
        choices=["auto", "suppress", "keep"],
        default="auto",
        help="bias EOS to -100 on every target: auto = only for real (non-random) "
        "weights, which would otherwise stop early",
    )

    c = sub.add_parser("compare", help="compare two results.json files of the same workload")
    c.add_argument("base", type=Path)
    c.add_argument("candidate", type=Path)
    c.add_argument(
        "--target",
        default="mlxd",
        help="which target's numbers: mlxd, engine, ceiling or peer (default mlxd)",
    )
    c.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="relative change that counts, beyond the 95%% interval (default 0.05)",
    )
    c.add_argument(
        "--min-parity",
        type=float,
        default=1.0,
        help="fraction of greedy requests that must match token for token (default 1.0; "
        "bf16 on GPUs is not batch-invariant: see docs/benchmarks/README.md)",
    )
    c.add_argument("--out", type=Path, help="also write the verdict as Markdown here")

    t = sub.add_parser("trace", help="one traced run of mlxd: Chrome/Perfetto JSON + summary")
    t.add_argument("--preset", choices=list(PRESETS), default="smoke")
    _model_args(t)
    t.add_argument(
        "--scenarios",
        default="sweep,mixed_pressure",
        help="comma-separated scenario names or kinds (default sweep,mixed_pressure)",
    )
    _mlxd_env_arg(t)
    return p


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if getattr(args, "url", None) and not _loopback(args.url):
        print(f"bench: --url must be a loopback address, not {args.url}", file=sys.stderr)
        return 2
    if args.command == "run":
        from bench.run import ALL_TARGETS, RunConfig, default_targets, run

        chosen = args.targets or ",".join(default_targets())
        targets = tuple(t.strip() for t in chosen.split(",") if t.strip())
        bad = [t for t in targets if t not in ALL_TARGETS]
        if bad or not targets:
            print(f"bench: unknown targets {bad}; choose from {ALL_TARGETS}", file=sys.stderr)
            return 2
        mlxd_env = _mlxd_env(args.mlxd_env)
        if mlxd_env is None:
            return 2
        if args.deadline_s is not None and not args.interleave:
            print("bench: --deadline-s needs --interleave", file=sys.stderr)
            return 2
        cfg = RunConfig(
            mlxd_env=mlxd_env,
            preset=args.preset,
            model=args.model,
            shape=args.shape,
            url=args.url,
            out=args.out,
            targets=targets,
            seed=args.seed,
            eos=args.eos,
            quiet=args.quiet,
            interleave=args.interleave,
            deadline_s=args.deadline_s,
            step_trace=args.step_trace,
            min_waves=max(0, args.min_waves),
            min_wave_requests=max(0, args.min_wave_requests),
            scenarios=tuple(x.strip() for x in args.scenarios.split(",") if x.strip()),
            argv=argv,
        )
        return run(cfg)
    if args.command == "compare":
        from bench.compare import compare_files

        return compare_files(
            args.base,
            args.candidate,
            target=args.target,
            threshold=args.threshold,
            min_parity=args.min_parity,
            out=args.out,
        )
    from bench.trace import TraceConfig, trace

    trace_env = _mlxd_env(args.mlxd_env)
    if trace_env is None:
        return 2
    return trace(
        TraceConfig(
            mlxd_env=trace_env,
            preset=args.preset,
            model=args.model,
            shape=args.shape,
            url=args.url,
            out=args.out,
            seed=args.seed,
            quiet=args.quiet,
            scenarios=tuple(s.strip() for s in args.scenarios.split(",") if s.strip()),
            argv=argv,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
