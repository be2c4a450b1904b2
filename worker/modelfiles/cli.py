"""The `mlxd model ...` subcommands, as plain functions returning exit codes.

This module owns what those commands print and how their failures read; argument
parsing lives in gateway/cli.py. Results go to stdout (the model directory, so scripts
can capture it), failures to stderr as one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1


def cmd_import_gguf(gguf: str, out: str, dtype: str) -> int:
    """Convert a llama GGUF file into an mlx-lm model directory at `out`."""
    from worker.modelfiles.gguf_import import import_gguf

    try:
        path = import_gguf(Path(gguf), Path(out), dtype=dtype)
    except (OSError, ValueError) as e:
        return _fail(f"cannot import {gguf}: {e}")
    print(path)
    return EXIT_OK


def cmd_default(cache_dir: str | None) -> int:
    """Make sure the embedded default model is converted, and print its directory."""
    from worker.modelfiles.default_model import ensure_default_model

    try:
        path = ensure_default_model(Path(cache_dir) if cache_dir else None)
    except (OSError, ValueError) as e:
        return _fail(f"cannot prepare the default model: {e}")
    print(path)
    return EXIT_OK


def cmd_random(
    out: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab_size: int,
    seed: int,
    tools: bool = False,
) -> int:
    """Write a tiny random-weight model (for tests and benchmarks) to `out`."""
    from worker.modelfiles.random_model import make_random_model

    try:
        path = make_random_model(
            Path(out),
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            vocab_size=vocab_size,
            seed=seed,
            tools=tools,
        )
    except (OSError, ValueError) as e:
        return _fail(f"cannot build the random model: {e}")
    print(path)
    return EXIT_OK


def _fail(message: str) -> int:
    # One line, whatever the exception text contains, so logs and scripts stay tidy.
    print("mlxd: error: " + " ".join(message.split()), file=sys.stderr)
    return EXIT_FAILED
