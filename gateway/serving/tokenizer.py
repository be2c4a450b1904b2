"""Text <-> tokens for the gateway: chat template, tokenization, detokenization, stops.

The worker deals in token ids only. This module owns all text work:
- `Frontend` loads the tokenizer of the model the worker serves (mlx-lm's
  TokenizerWrapper, so both sides use the same files) and runs the
  chat template and tokenization in a bounded thread pool, never on the event
  loop: a 100 KB prompt takes milliseconds of CPU. Large jobs (LARGE_JOB_CHARS
  of text or more) share all threads but one, so small requests never queue
  behind a few huge ones.
- `TextStream` is one request's streaming detokenizer plus its stop-string
  matcher. It runs on the event loop, per step, for one request at a time.

Importing mlx_lm.tokenizer_utils pulls in mlx.core as a module, but the
gateway never creates an array: all model memory stays in the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.serving.prompt_tokens import PromptTokens

# The gateway's one module that imports mlx-lm (make lint's import contracts): its
# tokenizer wrapper and streaming detokenizers below, and the text state machine
# that gateway/serving/reasoning.py runs over the detokenized output. Imported on
# first use, never at the gateway's import: mlx-lm brings transformers, 13 s on
# the H200 machine, and the gateway starts its worker first so that both
# processes' imports overlap (`preload`, gateway/workers/served_model.py).


def text_state_machine() -> Any:
    """mlx-lm's TextStateMachine class."""
    from mlx_lm.generate import TextStateMachine

    return TextStateMachine


def preload() -> None:
    """Import the tokenizer stack (mlx-lm, transformers) now, off the event loop."""
    import mlx_lm.generate
    import mlx_lm.tokenizer_utils  # noqa: F401


class TemplateError(ValueError):
    """The chat template refused the conversation."""


class Frontend:
    def __init__(self, model_path: str, eos_token_ids: list[int] | None, threads: int = 2) -> None:
        """`eos_token_ids` None: the model's own, as mlx-lm's load() (and so the
        worker) derives them from its config; a frontend built before the worker
        is ready uses that, and is kept only if the worker reports the same."""
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        path = Path(model_path)
        self.model_path = path
        if eos_token_ids is None:
            from mlx_lm.utils import load_config

            tok = load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))
            eos_token_ids = sorted(int(t) for t in tok.eos_token_ids)
        else:
            tok = load_tokenizer(path, eos_token_ids=eos_token_ids)
        self.tokenizer = tok
        hf = tok._tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        # Reasoning and tool-call markers (mlx-lm infers them from the vocabulary
        # and the chat template); gateway/serving/reasoning.py splits the output on them.
        self.think_start: str | None = tok.think_start
        self.think_end: str | None = tok.think_end
        self.tool_start: str | None = tok.tool_call_start
        self.tool_end: str | None = tok.tool_call_end
        self.tool_parser: Any = tok.tool_parser  # mlx_lm.tool_parsers.<name>.parse_tool_call
        self.tool_parser_name = (
            tok.tool_parser.__module__.rsplit(".", 1)[-1] if tok.tool_parser else None
        )
        self.added_ids = frozenset(int(i) for i in hf.get_added_vocab().values())
        template = hf.chat_template if isinstance(hf.chat_template, str) else ""
        # Templates that can turn thinking off read `enable_thinking` (Qwen3, ...).
        self.thinking_switch = "enable_thinking" in template
        markers = {
            t
            for seq in (
                tok.think_start_tokens,
                tok.think_end_tokens,
                tok.tool_call_start_tokens,
                tok.tool_call_end_tokens,
            )
            if seq is not None and len(seq) == 1
            for t in seq
        }
        # Special tokens (EOS, ChatML markers) are never rendered as text,
        # like skip_special_tokens in other servers; they still count in usage.
        # Marker tokens stay visible even when special: the splitter needs them.
        self.hidden_ids = (
            frozenset(int(i) for i in hf.all_special_ids) | self.eos_token_ids
        ) - markers
        self.has_chat_template = bool(getattr(self.tokenizer, "has_chat_template", False))
        # A chat turn's prompt extends the last turn's: its new part only is
        # tokenized (gateway/serving/prompt_tokens.py). Its checks of a reused
        # prompt run on a thread of their own, off the request's path and out
        # of the pool small requests count on.
        self._checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-check")
        self.prompts = PromptTokens(
            _encoder(hf.backend_tokenizer), self.added_ids, check_later=self._check_later
        )
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenizer")
        # Fairness: large jobs (a megabyte prompt, a huge schema) take at most
        # threads - 1 of the pool's threads, and wait here, not in the pool's
        # FIFO queue, so small requests always find a thread (#13 finding 7).
        self._large_jobs = asyncio.Semaphore(max(1, threads - 1))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._checks.shutdown(wait=False, cancel_futures=True)

    def _check_later(self, check: Any) -> None:
        with contextlib.suppress(RuntimeError):  # closed: the check is moot
            self._checks.submit(check)

    async def _run(self, fn: Any, *args: Any, size: int = 0) -> Any:
        """fn(*args) in the pool; `size` (characters of text) of LARGE_JOB_CHARS or
        more: one of the large jobs' threads."""
        loop = asyncio.get_running_loop()
        if size < LARGE_JOB_CHARS:
            return await loop.run_in_executor(self._pool, fn, *args)
        async with self._large_jobs:
            return await loop.run_in_executor(self._pool, fn, *args)

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        size = _text_size(messages) + _text_size(tools)
        return list(
            await self._run(self._apply_template, messages, tools, template_kwargs, size=size)
        )

    async def run(self, fn: Any, *args: Any) -> Any:
        """Run CPU-heavy text work (grammar validation, ...) in the tokenizer pool."""
        return await self._run(fn, *args, size=sum(len(a) for a in args if isinstance(a, str)))

    @property
    def has_thinking(self) -> bool:
        return self.think_start is not None

    @property
    def has_tool_calling(self) -> bool:
        return self.tool_start is not None and self.tool_parser is not None

    def ends_in_reasoning(self, prompt: list[int]) -> bool:
        """The prompt leaves a reasoning block open (the template opened it)."""
        if not self.has_thinking:
            return False
        tok = self.tokenizer
        return bool(tok.rfind_think_start(prompt) > tok.rfind_think_end(prompt))

    def marker_ids(self, text: str) -> list[int]:
        return self._encode(text)

    async def encode(self, text: str) -> list[int]:
        return list(await self._run(self._encode, text, size=len(text)))

    def _apply_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if not self.has_chat_template:
            raise TemplateError("this model has no chat template; use /v1/completions")
        try:
            # Rendered, then tokenized as apply_chat_template(tokenize=True)
            # does (no special tokens added: the template has them).
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=True,
                **(template_kwargs or {}),
            )
            # Anything but text (template kwargs can change the result's shape)
            # is the request's error, not the server's.
            if not isinstance(text, str):
                raise TypeError("the template did not produce text")
        except Exception as e:  # jinja raises for conversations it rejects
            detail = " ".join(str(e).split())[:300]
            raise TemplateError(f"chat template error: {type(e).__name__}: {detail}") from None
        return self.prompts.encode(text)

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens left out (a token-id prompt's echo and offsets)."""
        return str(self.tokenizer.decode([i for i in ids if i not in self.hidden_ids]))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def text_stream(self, stops: list[str], context: list[int] | None = None) -> TextStream:
        return TextStream(self.tokenizer.detokenizer, self.hidden_ids, stops, context)


def _encoder(backend: Any) -> Any:
    """text -> its Encoding, special tokens not added. Through encode_batch:
    `tokenizers` releases the GIL there and not in `encode`, and a megabyte
    prompt takes seconds to tokenize, which must not stop the event loop
    (tests/test_isolation.py: /live and a small chat answered meanwhile)."""

    def encode(text: str) -> Any:
        return backend.encode_batch([text], add_special_tokens=False)[0]

    return encode


def byte_table(detok: Any) -> list[bytes] | None:
    """token id -> its raw bytes, from a BPE or SentencePiece detokenizer's vocabulary
    (gateway/serving/logprobs); None for any other detokenizer."""
    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        _byte_decoder,
    )

    if isinstance(detok, BPEStreamingDetokenizer):
        decoder = _byte_decoder()
        return [
            b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in tok or "")
            for tok in detok.tokenmap
        ]
    if isinstance(detok, SPMStreamingDetokenizer):
        sep = "\u2581".encode()
        return [v.replace(sep, b" ") for v in detok.tokenmap]
    return None


@dataclass(slots=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: the text ends before it


class TextStream:
    """One request's incremental detokenizer with stop-string matching.

    Text that could be the beginning of a stop string is held back until it is
    known not to be one, so the client never sees part of a stop string.

    `context` (the prompt's last tokens) is detokenized first and not emitted:
    mlx-lm's detokenizers drop the leading space of the first text they produce,
    so without it " Paris" after "The capital of France is" would come out as
    "Paris", and prompt + text would no longer be what the model wrote.
    """

    def __init__(
        self,
        detokenizer: Any,
        hidden_ids: frozenset[int],
        stops: list[str],
        context: list[int] | None = None,
    ) -> None:
        self._detok = detokenizer
        self._detok.reset()
        self._hidden = hidden_ids
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._consumed = 0  # chars of detok.text already handed to the matcher
        visible = [t for t in context or [] if t not in hidden_ids]
        if visible:
            for t in visible[-4:]:
                self._detok.add_token(t)
            self._detok.finalize()  # flush it all: none of it may leak into the output
            self._consumed = len(self._detok.text)
        self._pending = ""  # text not yet emitted (possible stop prefix)
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched

    def add(self, token_ids: list[int], final: bool = False) -> TextDelta:
        if self.stopped:
            return TextDelta("", True)
        for t in token_ids:
            if t not in self._hidden:
                self._detok.add_token(t)
        if final:
            self._detok.finalize()
        text = self._detok.text
        self._pending += text[self._consumed :]
        self._consumed = len(text)
        return self._emit(final)

    def _emit(self, final: bool) -> TextDelta:
        if self._stops:
            hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
            if hits:
                cut, self.matched = min(hits)
                out, self._pending = self._pending[:cut], ""
                self.stopped = True
                return TextDelta(out, True)
        if final or not self._stops:
            out, self._pending = self._pending, ""
            return TextDelta(out, False)
        keep = min(self._hold, len(self._pending))
        split = len(self._pending) - keep
        # Hold back only a suffix that could still start a stop string.
        while keep > 0 and not any(s.startswith(self._pending[split:]) for s in self._stops):
            split += 1
            keep -= 1
        out, self._pending = self._pending[:split], self._pending[split:]
        return TextDelta(out, False)


LARGE_JOB_CHARS = 64 * 1024  # tokenizer jobs with this much text count as large


def _text_size(value: Any) -> int:
    """Characters of text in a JSON-like value (messages, tools): a job's size."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_size(v) for v in value)
    return 0
