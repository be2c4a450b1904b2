"""Constrained-decoding libraries compared on one tokenizer and one nested JSON schema.

    python -m bench.constraint_libs --tokenizer DIR [--libs llguidance,outlines,xgrammar]
                                    [--requests 20] [--seed 0]

For each library installed: the one-off setup (tokenizer tables), the per-schema
compile (cacheable by schema), the per-request setup (a matcher), then
`--requests` simulated generations, each picking a random allowed token from the
library's mask until the grammar completes. Times the mask fill
and the token advance per token (what the worker's logits processor pays per
step, before applying the mask) and checks every output parses as JSON.

mlxd depends only on llguidance; outlines-core and xgrammar (which needs torch)
are measured when present (docs/api.md#structured-output has the results).

Threading: single-threaded.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "tags", "address", "status"],
    "additionalProperties": False,
}

# A library: setup(hf tokenizer) -> (make(), schema compile ms) where make() returns a
# fresh request's (fill() -> int32 bitmask row, consume(token), done()).
Request = tuple[Callable[[], np.ndarray], Callable[[int], Any], Callable[[], bool]]
Setup = tuple[Callable[[], Request], float]


def _ms(start: float) -> float:
    return 1000 * (time.perf_counter() - start)


def _llguidance(hf: Any, vocab: int) -> Setup:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    start = time.perf_counter()  # the schema compiles lazily, inside each matcher
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    compile_ms = _ms(start)

    def make() -> Request:
        m = llguidance.LLMatcher(tok, grammar)
        bm = allocate_token_bitmask(1, vocab)

        def fill() -> np.ndarray:
            fill_next_token_bitmask(m, bm)
            return bm[0]

        return fill, m.consume_token, m.is_stopped

    return make, compile_ms


def _outlines(hf: Any, vocab: int) -> Setup:
    import outlines_core
    from mlx_lm.tokenizer_utils import _byte_decoder

    byte_decoder = _byte_decoder()
    special = set(hf.all_special_ids)
    mapping: dict[bytes, list[int]] = {}
    for text, i in hf.get_vocab().items():
        if i == hf.eos_token_id:
            continue
        try:
            raw = text.encode() if i in special else bytes(byte_decoder[c] for c in text)
        except KeyError:
            raw = text.encode()
        mapping.setdefault(raw, []).append(i)
    vocabulary = outlines_core.Vocabulary(hf.eos_token_id, mapping)
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)  # the per-schema compile
    compile_ms = _ms(start)
    words = (vocab + 31) // 32

    def make() -> Request:
        guide = outlines_core.Guide(index)
        bm = np.zeros((1, words), dtype=np.int32)

        def fill() -> np.ndarray:
            guide.write_mask_into(bm.ctypes.data, bm.size, 4)
            return bm[0]

        return fill, guide.advance, guide.is_finished

    return make, compile_ms


def _xgrammar(hf: Any, vocab: int) -> Setup:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_ms = _ms(start)

    def make() -> Request:
        m = xgrammar.GrammarMatcher(compiled)
        bm = xgrammar.allocate_token_bitmask(1, vocab)

        def fill() -> np.ndarray:
            m.fill_next_token_bitmask(bm)
            return np.asarray(bm.numpy()[0])

        return fill, m.accept_token, m.is_terminated

    return make, compile_ms


LIBS = {"llguidance": _llguidance, "outlines": _outlines, "xgrammar": _xgrammar}


def measure(name: str, hf: Any, requests: int, seed: int) -> dict[str, Any]:
    vocab = len(hf)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    make, schema_ms = LIBS[name](hf, vocab)
    setup_ms = _ms(start) - schema_ms  # the tokenizer tables: once per model
    per_token: list[float] = []
    compile_ms: list[float] = []
    valid = 0
    for _ in range(requests):
        t = time.perf_counter()
        fill, consume, done = make()
        compile_ms.append(1000 * (time.perf_counter() - t))
        tokens: list[int] = []
        for _ in range(1000):
            t = time.perf_counter()
            row = fill()
            spent = time.perf_counter() - t
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
            token = int(rng.choice(np.flatnonzero(bits)))
            if token == hf.eos_token_id or done():
                break
            t = time.perf_counter()
            consume(token)
            per_token.append(spent + time.perf_counter() - t)
            tokens.append(token)
        try:
            json.loads(hf.decode(tokens))
            valid += 1
        except ValueError:
            pass
    us = np.array(per_token) * 1e6
    return {
        "library": name,
        "vocab": vocab,
        "tokenizer_setup_ms": round(setup_ms),
        "schema_compile_ms": round(schema_ms, 2),
        "per_request_ms": round(float(np.mean(compile_ms)), 2),
        "per_token_us": {
            "mean": round(float(us.mean())),
            "p50": round(float(np.percentile(us, 50))),
            "p99": round(float(np.percentile(us, 99))),
        },
        "tokens": len(per_token),
        "valid": f"{valid}/{requests}",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.constraint_libs", description=__doc__)
    p.add_argument("--tokenizer", required=True, help="a model directory with tokenizer files")
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    for name in args.libs.split(","):
        try:
            print(json.dumps(measure(name, hf, args.requests, args.seed)))
        except ImportError as e:
            print(json.dumps({"library": name, "skipped": f"not installed ({e.name})"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
