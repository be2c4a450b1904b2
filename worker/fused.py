"""One forward pass for the decode rows and a prefill chunk (issue #12, item 3).

mlx-lm's BatchGenerator runs a step as two passes over the model: one for the
decoding rows (one token each), then one for the prompt chunk of the rows
still prefilling. On a GPU each pass has a fixed cost close to a whole decode
step (kernel launches for every layer), so a prompt arriving beside streams
stalls them for both. This module owns the alternative:

- `fused_hidden`: the model's layers over several row groups at once. Norms,
  the q/k/v/o projections and the MLP run once over all groups' new tokens
  (one matmul per weight, read once); attention runs per group over that
  group's own cache (the decode rows over the generation batch's
  BatchKVCache, the chunk over the prompt batch's). Written for the llama
  family's block (llama, mistral, qwen2, qwen3: pre-norm attention and MLP,
  optional q/k norms), which `supports_fusion` checks; anything else keeps
  mlx-lm's two passes.
- `FusedGenerator`: a BatchGenerator whose step runs the decode rows and the
  prompt chunk in that one pass when both exist. Admission, the prompt
  bookkeeping and the decode step's sampling are mlx-lm's own (the decode
  batch's `next()` runs unchanged; only its model call is answered by the
  fused pass). One difference in order (`early_join`, also without fusion):
  prompts that finished prefilling join the decode rows before this step's
  decode pass instead of after it. mlx-lm starts a joined row with its own
  pass over the row's last prompt token, and its decode step reports the
  tokens of the pass before; joined after the decode, a row's first token
  came out one whole step later than the pass that computed it. Joined
  before, it comes out in the same step: every request's TTFT is one step
  shorter, with the same passes per step and the same tokens.

Threading: engine thread only, like worker/runner.py.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

# Model families whose decoder block is the plain pre-norm attention + MLP that
# `fused_hidden` reproduces (their attention differs only by optional q/k norms).
FUSABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads")


def supports_fusion(model: Any) -> bool:
    """Whether `fused_hidden` computes exactly what this model's own forward does."""
    if getattr(model, "model_type", None) not in FUSABLE_MODEL_TYPES:
        return False
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return False
    if getattr(inner, "pipeline_size", 1) != 1 or getattr(inner, "swa_idx", None) is not None:
        return False  # pipeline ranks and sliding-window layers have their own masks
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in _ATTENTION_PARTS):
            return False
        if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm")):
            return False
    return True


def _attend(
    attn: Any, q: mx.array, k: mx.array, v: mx.array, rows: int, length: int, mask: Any, cache: Any
) -> mx.array:
    """One group's attention, as the model's Attention.__call__ does it after the projections."""
    q = q.reshape(rows, length, attn.n_heads, -1)
    k = k.reshape(rows, length, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = q.transpose(0, 2, 1, 3)
    k = k.transpose(0, 2, 1, 3)
    v = v.reshape(rows, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=cache.offset)
    k = attn.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(1, rows * length, -1)


def fused_hidden(model: Any, groups: list[tuple[mx.array, list[Any]]]) -> list[mx.array]:
    """The final hidden states of each (tokens (rows, length), per-layer caches) group.

    Every group's tokens are laid end to end as one sequence for everything but
    attention, so each weight is read once for all of them.
    """
    inner = model.model
    embedded = [inner.embed_tokens(tokens) for tokens, _ in groups]
    masks = [
        create_attention_mask(h, caches[0]) for h, (_, caches) in zip(embedded, groups, strict=True)
    ]
    shapes = [(int(h.shape[0]), int(h.shape[1])) for h in embedded]
    width = embedded[0].shape[-1]
    x = mx.concatenate([h.reshape(1, -1, width) for h in embedded], axis=1)
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        normed = layer.input_layernorm(x)
        q, k, v = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
        parts, start = [], 0
        for (rows, length), mask, (_, caches) in zip(shapes, masks, groups, strict=True):
            end = start + rows * length
            parts.append(
                _attend(
                    attn,
                    q[:, start:end],
                    k[:, start:end],
                    v[:, start:end],
                    rows,
                    length,
                    mask,
                    caches[i],
                )
            )
            start = end
        h = x + attn.o_proj(mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    out, start = [], 0
    for rows, length in shapes:
        # Normed per group: a prompt chunk's hidden states are never read (only
        # its caches are), so lazy evaluation skips its final norm entirely.
        out.append(inner.norm(x[:, start : start + rows * length]).reshape(rows, length, width))
        start += rows * length
    return out


def logits_of(model: Any, hidden: mx.array) -> mx.array:
    if getattr(model.args, "tie_word_embeddings", False):
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


class _OnePass:
    """Answers the decode batch's one model call with the fused pass, which also
    runs the prompt chunk into the prompt batch's caches."""

    def __init__(self, model: Any, chunk: mx.array, chunk_cache: list[Any]) -> None:
        self.model, self.chunk, self.chunk_cache = model, chunk, chunk_cache

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        decode, _ = fused_hidden(self.model, [(inputs, cache), (self.chunk, self.chunk_cache)])
        return logits_of(self.model, decode)


class FusedGenerator(BatchGenerator):
    """A BatchGenerator whose steps carry the decode rows and the prompt chunk in
    one forward pass when both exist (module docstring)."""

    def __init__(
        self, model: Any, *args: Any, fuse: bool = True, early_join: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(model, *args, **kwargs)
        self.fuse = fuse and supports_fusion(model)
        self.early_join = early_join
        self.fused_steps = 0

    def _next(self) -> tuple[list[Any], list[Any]]:
        gen = self._generation_batch
        if len(gen) >= self.completion_batch_size or not (
            len(self._prompt_batch) or self._unprocessed_sequences
        ):
            return super()._next()  # nothing to admit or prefill: mlx-lm's decode step
        fuse = self.fuse and len(gen) > 0
        if not (fuse or self.early_join):
            return super()._next()
        prompt_responses = self._admit_and_start_generating()
        chunks = self._cut_chunks(prompt_responses)
        if fuse:
            return prompt_responses, self._decode(chunks or None)
        # Two passes, in the early-join order: the decode pass (the rows that
        # joined included, so their first token is this step's), then the chunk.
        responses = self._decode(None) if len(gen) else []
        if chunks:
            self._counters.prompt_tokens += sum(len(c) for c in chunks)
            tic = time.perf_counter()
            self._prompt_batch.prompt(chunks)
            self._counters.prompt_time += time.perf_counter() - tic
        return prompt_responses, responses

    def _admit_and_start_generating(self) -> list[Any]:
        """mlx-lm's admission into the prompt batch, and its hand-over of the rows
        with only their last prompt token left to the decode batch (before this
        step's pass, so they decode in it)."""
        gen = self._generation_batch
        n = min(
            self.prefill_batch_size - len(self._prompt_batch),
            self.completion_batch_size - len(gen),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            self._prompt_batch.extend(self._make_batch(n))
        done = [
            i
            for i, seq in enumerate(self._currently_processing)
            if len(seq[0]) == 1 and len(seq[0][0]) == 1
        ]
        responses: list[Any] = []
        if done:
            last = [self._currently_processing[i][0][0] for i in done]
            progress = [(self._currently_processing[i][2],) * 2 for i in done]
            self._currently_processing = [
                seq for i, seq in enumerate(self._currently_processing) if i not in done
            ]
            started = self._prompt_batch.split(done).generate(last)
            for uid, p in zip(started.uids, progress, strict=True):
                responses.append(PromptProcessingBatch.Response(uid, p, True, True))
            gen.extend(started)
        return responses

    def _cut_chunks(self, responses: list[Any]) -> list[list[int]]:
        """This step's piece of every prompt still prefilling, as mlx-lm cuts it."""
        chunks = []
        for i, seq in enumerate(self._currently_processing):
            response = PromptProcessingBatch.Response(
                self._prompt_batch.uids[i], (0, 0), False, False
            )
            segments = seq[0]
            n = min(len(segments[0]), self.prefill_step_size)
            chunks.append(segments[0][:n])
            segments[0] = segments[0][n:]
            if len(segments[0]) == 0:
                segments.pop(0)
                response.end_of_segment = True
            seq[1] += len(chunks[-1])
            response.progress = (seq[1], seq[2])
            responses.append(response)
        return chunks

    def _decode(self, chunks: list[list[int]] | None) -> list[Any]:
        """The decode batch's step; with chunks, its pass also prefills them."""
        gen = self._generation_batch
        tic = time.perf_counter()
        if chunks is None:
            responses = gen.next()
        else:
            batch = self._prompt_batch
            tokens, padded = _pad_chunks(batch, chunks)
            gen.model = _OnePass(self.model, tokens, batch.prompt_cache)
            try:
                responses = gen.next()
            finally:
                gen.model = self.model
            if padded:  # move the padding to the left, as mlx-lm's prompt() does
                for c in batch.prompt_cache:
                    c.finalize()
            mx.eval([c.state for c in batch.prompt_cache])
            self._counters.prompt_tokens += sum(len(c) for c in chunks)
            self.fused_steps += 1
        self._counters.decode_time += time.perf_counter() - tic
        self._counters.generation_tokens += len(responses)
        self._counters.generation_steps += 1
        return responses


def _pad_chunks(batch: Any, chunks: list[list[int]]) -> tuple[mx.array, bool]:
    """The chunks as one (rows, length) array, right-padded as mlx-lm's
    PromptProcessingBatch.prompt pads them (the caches learn the padding)."""
    for seen, piece in zip(batch.tokens, chunks, strict=True):
        seen += piece
    lengths = [len(p) for p in chunks]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    if max(padding) == 0:
        return mx.array(chunks), False
    for c in batch.prompt_cache:
        c.prepare(lengths=lengths, right_padding=padding)
    return mx.array([p + [0] * (longest - len(p)) for p in chunks]), True
