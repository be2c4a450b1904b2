"""Which model a run uses, and the facts about it and the machine that go in the results.

Owns: the named random-weight shapes (`tiny` for smoke and tests, `qwen0.5b` and
`llama8b` for the GPU), creating them once under a cache directory, loading the
model's tokenizer (mlx-lm's TokenizerWrapper, as the gateway does) to render the
workload, and the identity/versions/machine facts recorded with every result.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    context_length: int
    dtype: str


SHAPES: dict[str, Shape] = {
    # A few hundred KiB: the serving machinery dominates, which is what smoke shows.
    "tiny": Shape(2, 64, 4, 2, 128, 512, 4096, "float32"),
    # Qwen2.5-0.5B-like and Llama-3-8B-like, bf16 (what /work/shared/gpu.md measured).
    "qwen0.5b": Shape(24, 896, 14, 2, 4864, 151936, 8192, "bfloat16"),
    "llama8b": Shape(32, 4096, 32, 8, 14336, 128256, 8192, "bfloat16"),
    # llama8b's 32 layers and 128-wide heads (4 query heads a KV head) at a
    # width whose matmuls cost next to nothing on a GPU: its steps are what a
    # step costs in kernel launches and host work (bench.pacing_probe).
    "thin32": Shape(32, 512, 4, 1, 512, 1024, 8192, "bfloat16"),
}

_MARKER = "bench_shape.json"


def default_cache_dir() -> Path:
    return Path(__file__).resolve().parent / "results" / "models"


def shape_model(name: str, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """The random-weight model of shape `name`, created on first use (then reused)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    shape = SHAPES[name]
    out = (cache_dir or default_cache_dir()) / f"{name}-seed{seed}"
    if (out / "config.json").is_file() and _marker(out).is_file():
        try:
            if json.loads(_marker(out).read_text()) == _want(name, seed):
                return out
        except ValueError:
            pass
    # In a child process: made here, the weights would stay in this process's
    # MLX cache on the device beside the server it then measures (session 42:
    # the 8B shape's 16 GB, and mlxd's worker ran out of device memory).
    spec = json.dumps({"out": str(out), "seed": seed, **asdict(shape)})
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "bench.models", spec], check=True, cwd=root)
    _marker(out).write_text(json.dumps(_want(name, seed)))
    return out


def _make(spec: dict[str, Any]) -> None:
    from worker.modelfiles.random_model import make_random_model

    make_random_model(Path(spec.pop("out")), **spec)


# Bumped when make_random_model's output changes for the same shape (2: reserved
# ids as plain vocabulary; 3: large tensors drawn from their own streams), so a
# model cached by an older version is made again.
_FORMAT = 3


def _want(name: str, seed: int) -> dict[str, Any]:
    return {"shape": name, "seed": seed, "format": _FORMAT, **asdict(SHAPES[name])}


def _marker(model_dir: Path) -> Path:
    # Beside the model, not in it: model_identity hashes every *.json in the directory.
    return model_dir.parent / f".{model_dir.name}.{_MARKER}"


def is_random_model(path: Path) -> bool:
    """Made by worker.modelfiles.random_model: its chat template or `<|reserved_N|>` padding."""
    from worker.modelfiles.random_model import CHATML_TEMPLATE

    try:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        if tok_config.get("chat_template") == CHATML_TEMPLATE:
            return True
        return "<|reserved_0|>" in (path / "tokenizer.json").read_text(errors="replace")
    except (OSError, ValueError):
        return False


class Tokenizer:
    """The model's tokenizer and chat template, as the gateway loads them."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer
        from transformers.utils import logging as hf_logging

        # Fitting prompts to a length encodes texts longer than the model's context.
        hf_logging.set_verbosity_error()
        self.wrapper = load_tokenizer(Path(model_dir))
        self.eos_token_ids = sorted(int(t) for t in self.wrapper.eos_token_ids)
        hf = getattr(self.wrapper, "_tokenizer", None)
        # Servers differ in whether they render these as text (mlxd hides them).
        self.special_tokens = sorted(str(t) for t in getattr(hf, "all_special_tokens", []))

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.wrapper.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def model_facts(model_dir: Path, shape: str | None) -> dict[str, Any]:
    from worker.runner import model_identity

    config = json.loads((model_dir / "config.json").read_text())
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "torch_dtype",
        "quantization",
    )
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return {
        "path": str(model_dir),
        "identity": model_identity(model_dir),
        "shape": shape,
        "random_weights": is_random_model(model_dir),
        "config": {k: config[k] for k in keys if k in config},
        "weights_bytes_on_disk": size,
    }


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in (
        "mlxd",
        "mlx",
        "mlx-lm",
        "mlx-cuda-13",
        "mlx-metal",
        "aiohttp",
        "transformers",
        "tokenizers",
        "numpy",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["git_commit"] = _git_commit()
    return out


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        r = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    head = r.stdout.strip() or None
    return f"{head}+dirty" if head and dirty.stdout.strip() else head


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python_executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "gpus": _gpus(),
    }
    return facts


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


def gpu_memory_bytes(gpus: list[str] | None = None) -> int | None:
    """The smallest NVIDIA GPU's memory (nvidia-smi's "name, N MiB, driver"), or None."""
    sizes = []
    for line in _gpus() if gpus is None else gpus:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].endswith(" MiB") and parts[1][:-4].isdigit():
            sizes.append(int(parts[1][:-4]) << 20)
    return min(sizes) if sizes else None


if __name__ == "__main__":
    _make(json.loads(sys.argv[1]))
