"""GGUF -> mlx-lm model directory conversion.

This module owns turning a llama-architecture GGUF file (what llama.cpp ships) into a
directory that `mlx_lm.load` reads: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json and a small
provenance file, `mlxd_import.json`, written last so its presence marks a complete import.

MLX reads GGUF itself (`mx.load`); Q4_0/Q4_1/Q8_0 blocks arrive as MLX affine quantized
weights with group size 32, everything else as plain arrays. What is left for us is the
naming, the config, and rebuilding the Hugging Face tokenizer from the GGUF vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# Written last into the output directory: its presence means the import finished.
IMPORT_MARKER = "mlxd_import.json"
# Bump when the output layout changes, so cached imports can be told apart.
IMPORT_FORMAT_VERSION = 1

SUPPORTED_ARCHITECTURES = ("llama",)
# "q4" keeps GGUF's quantized blocks as they are (Q4_x stays 4-bit, Q8_0 stays 8-bit)
# and quantizes any float matrix to 4 bits; "float32" dequantizes everything, which is
# what MLX's CPU backend runs fastest (through BLAS). Half precision is not offered: with
# float16 activations SmolLM2 overflows into garbage, and the CPU runs it very slowly.
DTYPES: dict[str, mx.Dtype | None] = {"q4": None, "float32": mx.float32}

# GGUF's Q4_0, Q4_1 and Q8_0 all use blocks of 32 values.
_GGUF_GROUP_SIZE = 32
_Q4_BITS = 4

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_NORMS = {"attn_norm", "ffn_norm", "output_norm"}
# `biases` is MLX's name for the affine quantization offsets, `bias` a real bias.
_SUFFIXES = ("weight", "scales", "biases", "bias")

# llama.cpp token types (llama_token_type): 1 normal, 3 control, 4 user defined.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# `tokenizer.ggml.pre` -> pre-tokenizer; ByteLevel(use_regex=True) is GPT-2's split regex.
_PRE_TOKENIZERS = {
    # SmolLM2 / SmolLM: every digit on its own, then GPT-2 byte-level splitting.
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}


def import_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: str = "q4",
    overwrite: bool = False,
) -> Path:
    """Convert `gguf_path` into an mlx-lm model directory at `out_dir` and return it.

    The directory is built beside `out_dir` and renamed into place, so readers never see
    a half-written model. An existing non-empty `out_dir` raises FileExistsError unless
    `overwrite` is set; that error is also what a process that lost a race to another
    importer of the same `out_dir` gets. Unsupported files raise ValueError.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not overwrite and _non_empty_dir(out_dir):
        raise FileExistsError(f"{out_dir} already exists and is not empty")

    weights, metadata = read_gguf(gguf_path)
    arch = _require_str(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    config = _llama_config(metadata)
    mlx_weights = _map_weights(weights, config["num_hidden_layers"], gguf_path)
    config["tie_word_embeddings"] = "lm_head.weight" not in mlx_weights
    config["attention_bias"] = any(
        k.endswith("_proj.bias") and "self_attn" in k for k in mlx_weights
    )
    config["mlp_bias"] = any(k.endswith("_proj.bias") and ".mlp." in k for k in mlx_weights)
    mlx_weights = _convert_dtype(mlx_weights, dtype)
    quantized = [k for k in mlx_weights if k.endswith(".scales")]
    if quantized:
        # The per-layer bits (8 for a Q8_0 embedding, say) are inferred by mlx-lm from
        # the shapes; this block only has to exist and name the group size.
        quant = {"group_size": _GGUF_GROUP_SIZE, "bits": _Q4_BITS}
        config["quantization"] = quant
        config["quantization_config"] = dict(quant)

    tokenizer, special = build_tokenizer(metadata)
    config.update({f"{name}_id": tok_id for name, (_, tok_id) in special.items()})
    tokenizer_config = _tokenizer_config(metadata, special, config["max_position_embeddings"])

    tmp = staging_dir(out_dir)
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), mlx_weights, {"format": "mlx"})
        _write_json(tmp / "config.json", config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(
            tmp / "special_tokens_map.json",
            {name: tok for name, (tok, _) in special.items()},
        )
        generation = {
            f"{name}_id": tok_id for name, (_, tok_id) in special.items() if name != "unk_token"
        }
        _write_json(tmp / "generation_config.json", generation)
        stat = gguf_path.stat()
        _write_json(
            tmp / IMPORT_MARKER,
            {
                "format_version": IMPORT_FORMAT_VERSION,
                "source": str(gguf_path.resolve()),
                "source_size": stat.st_size,
                "source_mtime": stat.st_mtime,
                "dtype": dtype,
                "created": time.time(),
            },
        )
        publish_dir(tmp, out_dir, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_gguf(gguf_path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Load tensors and metadata, turning every way a bad file fails into ValueError."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    # mx.load would pick the format from the file name; check the magic ourselves so a
    # stray file gets a clear message rather than a parser error from deep inside MLX.
    with gguf_path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file (bad magic)")
    try:
        loaded = mx.load(str(gguf_path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {gguf_path}: {e}") from e
    return cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)


def build_tokenizer(metadata: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, tuple[str, int]]]:
    """Rebuild the byte-level BPE tokenizer described by the `tokenizer.ggml.*` keys.

    Returns the tokenizer and the special tokens as {"bos_token": (text, id), ...}.
    """
    kind = _require_str(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZERS)})"
        )
    tokens = _require(metadata, "tokenizer.ggml.tokens")
    merges = _require(metadata, "tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens contains duplicate tokens")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()

    raw_types = metadata.get("tokenizer.ggml.token_type")
    types = cast(list[int], raw_types.tolist()) if isinstance(raw_types, mx.array) else []
    if len(types) != len(tokens):
        types = [1] * len(tokens)
    # Tokens are already in the vocabulary, so adding them keeps their ids; it makes the
    # tokenizer match them whole in the input instead of splitting them into bytes.
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, t in zip(tokens, types, strict=True)
            if t == _TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, t in zip(tokens, types, strict=True)
            if t == _TOKEN_USER_DEFINED
        ]
    )

    special: dict[str, tuple[str, int]] = {}
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        if key in metadata:
            tok_id = int(_scalar(metadata[key]))
            if not 0 <= tok_id < len(tokens):
                raise ValueError(f"{key}={tok_id} is outside the vocabulary")
            special[name] = (tokens[tok_id], tok_id)
    if "eos_token" not in special:
        raise ValueError("GGUF metadata has no tokenizer.ggml.eos_token_id")

    if _flag(metadata, "tokenizer.ggml.add_bos_token") and "bos_token" in special:
        bos, bos_id = special["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer, special


def staging_dir(out_dir: Path) -> Path:
    """A fresh directory beside `out_dir` to build into, then hand to publish_dir()."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    # mkdtemp makes it private (0700); the published model should read like any directory.
    tmp.chmod(0o755)
    return tmp


def publish_dir(tmp: Path, out_dir: Path, *, overwrite: bool) -> None:
    """Rename the finished `tmp` to `out_dir`; FileExistsError if someone else got there."""
    try:
        # rename() onto an empty directory replaces it; onto a non-empty one it fails.
        os.rename(tmp, out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    if not overwrite:
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, trash / out_dir.name)
    os.rename(tmp, out_dir)
    shutil.rmtree(trash, ignore_errors=True)


def _llama_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    def get(key: str) -> Any:
        return _scalar(_require(metadata, f"llama.{key}"))

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(_scalar(metadata.get("llama.attention.head_count_kv", heads)))
    head_dim = int(_scalar(metadata.get("llama.attention.key_length", hidden // heads)))
    rope_dim = int(_scalar(metadata.get("llama.rope.dimension_count", head_dim)))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported")
    if "llama.vocab_size" in metadata:
        vocab_size = int(_scalar(metadata["llama.vocab_size"]))
    else:
        vocab_size = len(_require(metadata, "tokenizer.ggml.tokens"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # GGUF stores it as float32; 7 significant digits turn 9.99999974e-06 back into 1e-05.
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon'):.7g}"),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(_scalar(metadata.get("llama.rope.freq_base", 10000.0))),
        # llama.cpp's converter permutes the q/k rows so that RoPE rotates adjacent
        # pairs (the "traditional" layout); without this the model produces garbage.
        "rope_traditional": True,
    }


def _map_weights(
    weights: Mapping[str, mx.array], num_layers: int, gguf_path: Path
) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        out[_mlx_name(name, gguf_path)] = value
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(num_layers):
        required += [f"model.layers.{i}.{mlx}.weight" for mlx in _BLOCK_TENSORS.values()]
    missing = [k for k in required if k not in out]
    if missing:
        raise ValueError(f"{gguf_path}: missing tensors for {', '.join(missing[:5])}")
    return out


def _mlx_name(name: str, gguf_path: Path) -> str:
    base, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        raise ValueError(f"{gguf_path}: unexpected tensor {name!r}")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}.{suffix}"
    # Unknown tensors (rope_freqs, say) change the model's maths; refusing is safer
    # than silently producing a model that talks nonsense.
    raise ValueError(f"{gguf_path}: tensor {name!r} has no llama equivalent in mlx-lm")


def _convert_dtype(weights: dict[str, mx.array], dtype: str) -> dict[str, mx.array]:
    target = DTYPES[dtype]
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        prefix = name.removesuffix(".weight")
        scales = weights.get(f"{prefix}.scales")
        if name.endswith(".weight") and scales is not None:
            biases = weights[f"{prefix}.biases"]
            if target is None:
                out.update({name: value, f"{prefix}.scales": scales, f"{prefix}.biases": biases})
                continue
            bits = value.shape[-1] * 32 // (scales.shape[-1] * _GGUF_GROUP_SIZE)
            value = mx.dequantize(
                value, scales, biases, group_size=_GGUF_GROUP_SIZE, bits=bits
            ).astype(target)
        elif target is not None:
            value = value.astype(target)
        elif value.ndim == 2 and value.shape[-1] % _GGUF_GROUP_SIZE == 0:
            # A float matrix in a GGUF that is otherwise quantized (or an F16 GGUF).
            w, s, b = mx.quantize(value, group_size=_GGUF_GROUP_SIZE, bits=_Q4_BITS)
            out.update({name: w, f"{prefix}.scales": s, f"{prefix}.biases": b})
            continue
        # Norms keep GGUF's float32 in "q4": casting them to float16 makes the
        # activations float16, which overflows in SmolLM2 and is very slow on the CPU.
        out[name] = value
    mx.eval(out)
    return out


def _tokenizer_config(
    metadata: Mapping[str, Any], special: Mapping[str, tuple[str, int]], context: int
) -> dict[str, Any]:
    config: dict[str, Any] = {
        # The generic class takes tokenizer.json exactly as written, with no
        # model-specific defaults layered on top by transformers.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "add_bos_token": _flag(metadata, "tokenizer.ggml.add_bos_token"),
        "add_eos_token": _flag(metadata, "tokenizer.ggml.add_eos_token"),
    }
    config.update({name: tok for name, (tok, _) in special.items()})
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config


def _non_empty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _require(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata is missing {key!r}")
    return metadata[key]


def _require_str(metadata: Mapping[str, Any], key: str) -> str:
    value = _require(metadata, key)
    if not isinstance(value, str):
        raise ValueError(f"GGUF metadata {key!r} is not a string")
    return value


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) else value


def _flag(metadata: Mapping[str, Any], key: str) -> bool:
    return bool(_scalar(metadata.get(key, False)))


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
