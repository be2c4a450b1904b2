"""Logprobs in the OpenAI shapes: chat `logprobs.content` and completions' legacy lists.

Owns the token-level view of an answer:
- which tokens a logprobs list covers: exactly the tokens of the returned text,
  so special tokens the text never shows (EOS, `<|im_end|>`) are left out, and a
  non-streamed answer cut by a stop string loses the tokens past the cut;
- each token's raw `bytes` (a token may hold part of a UTF-8 character: its
  bytes are that part, so joining every token's bytes rebuilds the text);
- completions' `text_offset`: each token's character offset in prompt + text
  (OpenAI's convention), counted with an incremental UTF-8 decoder so a token
  that starts inside a character points at that character.

Threading: event loop only; `TokenBytes` tables are built once per Frontend.
"""

from __future__ import annotations

import codecs
from typing import Any

from gateway.serving.generation import Chunk
from gateway.serving.tokenizer import Frontend, byte_table


class TokenBytes:
    """token id -> the raw bytes it stands for, read from the detokenizer's vocabulary."""

    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend
        # Read from mlx-lm's detokenizer in gateway/serving/tokenizer (the one
        # gateway module that imports mlx-lm).
        self._table = byte_table(frontend.tokenizer.detokenizer)

    def __call__(self, token_id: int) -> bytes:
        if self._table is not None and 0 <= token_id < len(self._table):
            return self._table[token_id]
        return self._frontend.token_text(token_id).encode()


def token_bytes(frontend: Frontend) -> TokenBytes:
    """The Frontend's table, built on first use."""
    table = getattr(frontend, "_token_bytes", None)
    if table is None:
        table = TokenBytes(frontend)
        frontend._token_bytes = table  # type: ignore[attr-defined]
    return table


def visible_tokens(frontend: Frontend, chunks: list[Chunk], text: str | None = None) -> list[int]:
    """Positions (into the chunks' concatenated token ids) of the tokens behind the text.

    Hidden special tokens are skipped. With `text` (a whole answer), tokens that
    start at or past its last byte are dropped too: what a stop string cut off.
    """
    hidden = frontend.hidden_ids
    raw = token_bytes(frontend)
    limit = len(text.encode()) if text is not None else None
    out, pos, at = [], 0, 0
    for c in chunks:
        for tok in c.token_ids:
            if tok not in hidden and (limit is None or at < limit):
                out.append(pos)
                at += len(raw(tok))
            pos += 1
    return out


def _flat(chunks: list[Chunk]) -> tuple[list[int], list[float | None], list[list[Any]]]:
    ids, lps, tops = [], [], []
    for c in chunks:
        n = len(c.token_ids)
        ids += c.token_ids
        lps += list(c.logprobs or [])[:n] + [None] * max(0, n - len(c.logprobs or []))
        t = list(c.top_logprobs or [])
        tops += t[:n] + [[]] * max(0, n - len(t))
    return ids, lps, tops


def chat_logprobs(frontend: Frontend, chunks: list[Chunk], text: str | None = None) -> list[Any]:
    """`choices[].logprobs.content`: one entry per visible token."""
    raw = token_bytes(frontend)
    ids, lps, tops = _flat(chunks)
    out = []
    for i in visible_tokens(frontend, chunks, text):
        tok = ids[i]
        out.append(
            {
                "token": frontend.token_text(tok),
                "logprob": lps[i],
                "bytes": list(raw(tok)),
                "top_logprobs": [
                    {
                        "token": frontend.token_text(int(tid)),
                        "logprob": v,
                        "bytes": list(raw(int(tid))),
                    }
                    for tid, v in tops[i]
                ],
            }
        )
    return out


class TextOffsets:
    """Completions' text_offset, carried across a stream's chunks."""

    def __init__(self, base: int) -> None:
        self.at = base  # characters of prompt + text before the next token
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, data: bytes) -> int:
        """The offset of a token with these bytes; advances past it."""
        offset = self.at
        self.at += len(self._decoder.decode(data))
        return offset


def completion_logprobs(
    frontend: Frontend, chunks: list[Chunk], offsets: TextOffsets, text: str | None = None
) -> dict[str, Any]:
    """A completion choice's `logprobs` (legacy shape), one entry per visible token."""
    raw = token_bytes(frontend)
    ids, lps, tops = _flat(chunks)
    tokens, token_lps, top_maps, text_offset = [], [], [], []
    for i in visible_tokens(frontend, chunks, text):
        tok = ids[i]
        tokens.append(frontend.token_text(tok))
        token_lps.append(lps[i])
        top_maps.append({frontend.token_text(int(tid)): v for tid, v in tops[i]})
        text_offset.append(offsets.next(raw(tok)))
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": top_maps,
        "text_offset": text_offset,
    }
