"""The `mlxd` command: serve, worker, bench, model {import-gguf, default, random}.

`serve` runs the gateway (which spawns the worker). `worker` is the worker
process itself, normally started by the gateway. The `model` commands prepare
model directories; they run in their own process and import MLX lazily, so the
gateway's start-up never pays for them.
"""

from __future__ import annotations

import argparse
import sys

from protocol import exit_codes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxd", description="Local LLM inference service on MLX")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("--config", help="TOML config file (default ~/.config/mlxd/mlxd.toml)")
    s.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M)")
    s.add_argument("--model-name", help="the model id clients use (default: directory name)")
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8000)")
    s.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="accept this bearer key with every scope (repeatable; visible in ps: "
        "prefer api_keys in the config file or MLXD_API_KEYS)",
    )
    s.add_argument(
        "--allow-unauthenticated-remote",
        action="store_true",
        default=None,
        help="allow a non-loopback --host with no API keys",
    )
    s.add_argument("--max-in-flight", type=int, help="in-flight request cap (default max_batch)")
    s.add_argument("--max-queued", type=int, help="queued request cap (default 128)")
    s.add_argument(
        "--request-timeout",
        type=float,
        dest="request_timeout_s",
        help="per-request timeout in seconds (default 600)",
    )
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--trace-file", help="write Chrome trace (Perfetto) JSON of requests here")

    sub.add_parser("worker", help="the model worker process (started by `serve`)", add_help=False)
    sub.add_parser(
        "bench", help="load benchmark: run, compare, trace (python -m bench)", add_help=False
    )

    m = sub.add_parser("model", help="prepare model directories")
    msub = m.add_subparsers(dest="model_command", required=True)
    g = msub.add_parser("import-gguf", help="convert a llama GGUF file into an MLX model dir")
    g.add_argument("gguf")
    g.add_argument("out")
    g.add_argument("--dtype", choices=["q4", "float32"], default="q4")
    d = msub.add_parser("default", help="install the embedded default model; print its dir")
    d.add_argument("--cache-dir")
    r = msub.add_parser("random", help="write a tiny random-weight model for tests")
    r.add_argument("out")
    r.add_argument("--layers", type=int, default=2)
    r.add_argument("--hidden", type=int, default=64)
    r.add_argument("--heads", type=int, default=4)
    r.add_argument("--kv-heads", type=int, default=2)
    r.add_argument("--intermediate", type=int, default=128)
    r.add_argument("--vocab-size", type=int, default=512)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument(
        "--tools",
        action="store_true",
        help="add tool-call and thinking markers and a template that renders tools",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["worker"]:
        from worker.proc import main as worker_main

        return worker_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    from worker.modelfiles import cli as model_cli

    if args.model_command == "import-gguf":
        return model_cli.cmd_import_gguf(args.gguf, args.out, args.dtype)
    if args.model_command == "default":
        return model_cli.cmd_default(args.cache_dir)
    return model_cli.cmd_random(
        args.out,
        args.layers,
        args.hidden,
        args.heads,
        args.kv_heads,
        args.intermediate,
        args.vocab_size,
        args.seed,
        args.tools,
    )


def _serve(args: argparse.Namespace) -> int:
    from protocol.hidden_imports import hide_unused_frameworks

    hide_unused_frameworks()  # first: before anything can import mlx-lm
    from gateway.config import ConfigError, load_settings
    from gateway.http import slow_clients
    from gateway.http.app import configure_logging, create_app

    try:
        settings = load_settings(
            args.config,
            cli_api_keys=args.api_key,
            model=args.model,
            model_name=args.model_name,
            host=args.host,
            port=args.port,
            allow_unauthenticated_remote=args.allow_unauthenticated_remote,
            max_in_flight=args.max_in_flight,
            max_queued=args.max_queued,
            request_timeout_s=args.request_timeout_s,
            log_level=args.log_level,
            trace_file=args.trace_file,
        )
    except ConfigError as e:
        print(f"mlxd: {e}", file=sys.stderr)
        return exit_codes.BAD_CONFIG
    configure_logging(settings.log_level)
    import asyncio

    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # uvloop is optional on platforms without wheels
        loop = asyncio.new_event_loop()
    # web.run_app, with a connection cap and header/body timeouts (slow_clients).
    slow_clients.run(
        create_app(settings),
        settings,
        loop,
        handler_cancellation=True,
        # In-flight requests get this long to finish after SIGTERM (see app._drain).
        shutdown_timeout=settings.shutdown_grace_s,
        access_log=None,
    )
    # The worker is stopped and every request answered by now. Skip the
    # interpreter's teardown: native threads of the tokenizer stack (mlx,
    # tokenizers) can abort in their static destructors ("terminate called
    # without an active exception"), which launchd and systemd would read as
    # a crash of a clean stop.
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
