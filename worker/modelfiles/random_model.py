"""Tiny random-weight llama models for tests and benchmarks of the serving machinery.

This module owns building, in about a second and without any download, a model
directory that `mlx_lm.load` reads like a real one: a llama config, random weights, and
a real byte-level BPE tokenizer trained in-process on a small built-in English corpus,
with the ChatML special tokens and chat template. The model talks nonsense, but it is
deterministic for a seed and its greedy continuation depends on the prompt.

With `tools=True` the tokenizer also has Hermes/Qwen-style markers (`<tool_call>`,
`</tool_call>`, `<think>`, `</think>`, `<tool_response>`, `</tool_response>`, as
non-special added tokens like Qwen's, so they decode to text) and a Qwen-like template
that renders tools, tool calls, tool results and reasoning and honours
`enable_thinking`. mlx-lm then infers the `json_tools` parser and `<think>` reasoning
from it, which lets tests drive the tool-call and reasoning paths of the server.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.modelfiles.gguf_import import publish_dir, staging_dir

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOOL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
)

# Qwen2.5/Qwen3-like. mlx-lm infers the json_tools parser from "<tool_call>" together
# with "tool_call.name", and reasoning from the <think> tokens in the vocabulary.
# enable_thinking: mlx-lm passes True by default for a model with thinking tokens;
# false pre-fills an empty reasoning block, true opens one.
TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n"
    "\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{ \'\\n<tool_call>\\n{\\"name\\": \\"\' + tool_call.name + \'\\", \\"arguments\\": \' }}'
    "{{ (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content }}"
    "{{ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking %}"
    "{{ '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# BPE learns about 500 merges from this (772 tokens in all); larger vocabularies are
# filled up with placeholder tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the old barn.
A small language model answers questions, writes short stories, and explains ideas.
What is the capital of France? The capital of France is Paris, a city on the Seine.
Berlin is the capital of Germany, Madrid of Spain, Rome of Italy and Lisbon of Portugal.
In 1969, two astronauts walked on the Moon; 384400 kilometres separate it from Earth.
Please summarise the following paragraph in three sentences, keeping the main points.
Servers receive requests, schedule them in batches, and stream tokens back to clients.
Every morning she drinks coffee, reads the newspaper, and walks her dog to the park.
Mathematics: 2 + 2 = 4, 7 * 8 = 56, and the square root of 144 is 12.
Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees.
The library opens at nine o'clock; children borrow picture books about dragons and ships.
Rain fell softly on the roofs of the village as the evening lights came on one by one.
Good software is tested, documented, and simple enough that others can change it safely.
Why do leaves change colour in autumn? Chlorophyll fades and other pigments appear.
He said: "I'll be there at 5 pm, don't worry!" and then he hung up the telephone.
Mountains, rivers, forests and deserts shape the climate and the life of each region.
Thank you for your question. Here is a short answer, followed by a longer explanation.
"""

# Embeddings and projections far larger than a trained model's: with the usual 0.02 the
# residual stream is so uniform that every prompt gets the same greedy continuation.
_EMBED_STD = 1.0


def make_random_model(
    out_dir: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int = 512,
    context_length: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    tools: bool = False,
) -> Path:
    """Write a random llama model directory to `out_dir` (replacing it) and return it.

    `vocab_size` counts every token, the three special tokens included; it must leave
    room for the 256 byte tokens. Beyond what BPE learns from the built-in corpus the
    vocabulary is filled with `<|reserved_N|>` tokens, so the embedding has exactly
    `vocab_size` rows and every id the model can emit decodes to something.
    `tools=True` adds the tool-call and reasoning markers (TOOL_TOKENS) and TOOLS_TEMPLATE.
    """
    out_dir = Path(out_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    least = 256 + len(SPECIAL_TOKENS) + (len(TOOL_TOKENS) if tools else 0)
    if vocab_size < least:
        raise ValueError(f"vocab_size must be at least {least}")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be a multiple of heads, and heads of kv_heads")

    tokenizer = train_tokenizer(vocab_size, TOOL_TOKENS if tools else ())
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": context_length,
        "rope_theta": 10000.0,
        # A separate random lm_head makes the next token depend on the whole context;
        # tied embeddings mostly echo the last input token.
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|im_start|>"],
        "eos_token_id": ids[EOS_TOKEN],
        "torch_dtype": dtype,
    }
    weights = _random_weights(config, seed, _DTYPES[dtype])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": "<|endoftext|>",
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "chat_template": TOOLS_TEMPLATE if tools else CHATML_TEMPLATE,
    }

    tmp = staging_dir(out_dir)
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, {"format": "mlx"})
        _write_json(tmp / "config.json", config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        publish_dir(tmp, out_dir, overwrite=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def train_tokenizer(vocab_size: int, extra_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE tokenizer like SmolLM2's, trained on the built-in corpus.

    `extra_tokens` become non-special added tokens (they decode to their text).
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(extra_tokens),
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a token, so any text encodes and round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    # BPE stops early once the corpus runs out of merges: the rest of the
    # vocabulary is reserved tokens.
    reserved = [
        f"<|reserved_{i}|>"
        for i in range(vocab_size - tokenizer.get_vocab_size() - len(extra_tokens))
    ]
    if extra_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
        tokenizer.add_tokens(reserved)  # after the extras: their ids stay next to the vocabulary
        return tokenizer
    # As plain vocabulary entries (no merge forms them), as a real model's unused
    # ids are: as added tokens, transformers deep-copies every one at each load
    # (the 152k-entry benchmark shapes took 5.3 s to load on the H200 machine).
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for token in reserved:
        vocab[token] = len(vocab)
    return Tokenizer.from_str(json.dumps(data))


def _corpus_lines() -> Iterator[str]:
    # Repetition gives the merges realistic counts; it does not add new ones.
    for _ in range(4):
        yield from _CORPUS.splitlines(keepends=True)


# A tensor this large is drawn from its own stream on a worker thread (numpy
# releases the GIL while it fills), in float32 directly: the 8B shape's 8e9
# weights took about 250 s one stream at a time on the lent H200's host, a
# sixth of a session's device time. Smaller ones (every tensor of the tests'
# models) come from the one seeded stream as before, so their values stay.
_PARALLEL_ELEMENTS = 1 << 22


def _random_weights(config: dict[str, Any], seed: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    # Take names and shapes from mlx-lm's own llama, so they always match what it loads.
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    shapes = {name: tuple(value.shape) for name, value in params}
    names = sorted(shapes)
    big = [n for n in names if not n.endswith("norm.weight")]
    big = [n for n in big if math.prod(shapes[n]) >= _PARALLEL_ELEMENTS]
    children = np.random.SeedSequence([seed, _PARALLEL_ELEMENTS]).spawn(len(big))
    streams = dict(zip(big, children, strict=True))

    def draw(name: str) -> np.ndarray:
        value = np.random.default_rng(streams[name]).standard_normal(shapes[name], np.float32)
        value *= np.float32(_std(name, shapes[name]))
        return value

    rng = np.random.default_rng(seed)
    weights: dict[str, mx.array] = {}
    workers = max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        # At most two tensors per worker in flight: the 8B shape is 32 GB in float32.
        pending = iter(big)
        drawn = {n: pool.submit(draw, n) for n in itertools.islice(pending, 2 * workers)}
        for name in names:
            shape = shapes[name]
            if name in drawn:
                value = drawn.pop(name).result()
                nxt = next(pending, None)
                if nxt is not None:
                    drawn[nxt] = pool.submit(draw, nxt)
            elif name.endswith("norm.weight"):
                value = np.ones(shape, dtype=np.float32)
            else:
                value = rng.normal(0.0, _std(name, shape), shape).astype(np.float32)
            weights[name] = mx.array(value).astype(dtype)
            mx.eval(weights[name])  # the float32 copy goes now, not at the save
    return weights


def _std(name: str, shape: tuple[int, ...]) -> float:
    # 1/sqrt(fan_in) keeps activations at unit scale through every layer.
    return _EMBED_STD if "embed_tokens" in name else shape[-1] ** -0.5


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
