"""gateway/serving/prompt_tokens.py: a chat turn's prompt tokenized from where
the last turn's left off gives the ids the whole text would, with real
tokenizers (the test model's and, where it is installed, the default model's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from gateway.serving.prompt_tokens import PromptTokens, _common_prefix
from gateway.serving.tokenizer import Frontend
from worker.modelfiles.default_model import default_cache_dir

WORDS = ["hello", " world", "\n", "  ", "über", "日本", "<|im_end|>", "x" * 40, "12,345", "!?"]


def _frontends(tiny_model_dir: Path, tiny_tools_model_dir: Path) -> list[Frontend]:
    dirs = [tiny_model_dir, tiny_tools_model_dir]
    dirs += [p for p in (default_cache_dir() / "models").glob("*") if (p / "config.json").exists()]
    return [Frontend(str(d), None, threads=1) for d in dirs]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(n))


def _whole(f: Frontend, messages: list[dict[str, Any]]) -> list[int]:
    """The ids as apply_chat_template(tokenize=True) gives them."""
    ids = f.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return [int(i) for i in ids]


def test_growing_chats_get_the_whole_texts_ids_and_reuse_the_earlier_turns(
    tiny_model_dir: Path, tiny_tools_model_dir: Path
) -> None:
    rng = random.Random(0)
    for f in _frontends(tiny_model_dir, tiny_tools_model_dir):
        chats: list[list[dict[str, Any]]] = [
            [{"role": "system", "content": _text(rng, 200)}] for _ in range(3)
        ]
        for _ in range(4):  # turns, interleaved across the chats
            for chat in chats:
                chat.append({"role": "user", "content": _text(rng, rng.randrange(1, 30))})
                assert f._apply_template(chat) == _whole(f, chat)
                chat.append({"role": "assistant", "content": _text(rng, rng.randrange(0, 30))})
        f._checks.submit(lambda: None).result()  # the checks queued before it have run
        assert f.prompts.enabled and f.prompts.checks_failed == 0
        assert f.prompts.reused_tokens > 0  # later turns reused the earlier ones
        # Edits inside the history (not only appends) still give the whole text's ids.
        chats[0][1]["content"] += "edited"
        assert f._apply_template(chats[0]) == _whole(f, chats[0])
        f.close()


class _Encoding:
    def __init__(self, ids: list[int], offsets: list[tuple[int, int]]) -> None:
        self.ids, self.offsets = ids, offsets

    def token_to_chars(self, i: int) -> tuple[int, int]:
        return self.offsets[i]


class _CharTokenizer:
    """One id per character, '#' an added token; with `context`, a character's
    id also depends on its place in the text (pieces not independent)."""

    def __init__(self, context: bool = False) -> None:
        self.context = context
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        self.calls += 1
        ids = [
            0 if c == "#" else ord(c) + (1000 * i if self.context else 0)
            for i, c in enumerate(text)
        ]
        return _Encoding(ids, [(i, i + 1) for i in range(len(text))])


def test_a_tokenizer_whose_pieces_are_not_independent_turns_reuse_off() -> None:
    tok = _CharTokenizer(context=True)
    prompts = PromptTokens(tok.encode, {0}, verify=2, least=1)
    first = "ab#cd#ef"
    assert prompts.encode(first) == tok.encode(first).ids
    longer = first + "gh#ij"
    assert prompts.encode(longer) == tok.encode(longer).ids  # the check caught it
    assert not prompts.enabled and prompts.reused_tokens == 0


def test_checks_handed_elsewhere_stay_off_the_callers_path() -> None:
    """With `check_later` a reuse returns at once; its check, run afterwards,
    still turns reuse off for a tokenizer whose pieces are not independent."""
    tok = _CharTokenizer(context=True)
    later: list[Any] = []
    prompts = PromptTokens(tok.encode, {0}, verify=1, least=1, check_later=later.append)
    prompts.encode("ab#cd#")
    tok.calls = 0
    reused = prompts.encode("ab#cd#ef")
    assert tok.calls == 1 and len(later) == 1  # the tail only; the check waits
    assert reused != tok.encode("ab#cd#ef").ids  # (this tokenizer's pieces depend on place)
    assert prompts.enabled
    later.pop()()
    assert not prompts.enabled and prompts.checks_failed == 1
    assert prompts.encode("ab#cd#ef#g") == tok.encode("ab#cd#ef#g").ids
    assert not later  # reuse is off: nothing more to check

    fine = _CharTokenizer()
    prompts = PromptTokens(fine.encode, {0}, verify=1, least=1, check_later=later.append)
    prompts.encode("ab#cd#")
    assert prompts.encode("ab#cd#ef") == fine.encode("ab#cd#ef").ids
    later.pop()()
    assert prompts.enabled and prompts.checks_failed == 0


def test_reuse_tokenizes_only_the_new_part_once_checked() -> None:
    tok = _CharTokenizer()
    prompts = PromptTokens(tok.encode, {0}, verify=1, least=1)
    prompts.encode("ab#cd#")
    tok.calls = 0
    assert prompts.encode("ab#cd#ef#") == tok.encode("ab#cd#ef#").ids
    assert tok.calls == 1 + 1 + 1  # the tail, the one check, and this assert's own
    tok.calls = 0
    text = "ab#cd#ef#gh"
    assert prompts.encode(text) == [ord(c) if c != "#" else 0 for c in text]
    assert tok.calls == 1  # the tail only, from the last '#' both share
    assert prompts.reused_tokens == 5 + 8
    assert prompts.encode(text) == [ord(c) if c != "#" else 0 for c in text]
    assert tok.calls == 1  # the same text again: no tokenizing at all


def test_a_short_shared_prefix_is_not_worth_a_reuse() -> None:
    tok = _CharTokenizer()
    prompts = PromptTokens(tok.encode, {0}, verify=1, least=4)
    prompts.encode("ab#cd#")
    prompts.encode("ab#zz#")  # shares 2 ids: tokenized whole, no check spent
    assert prompts.reused_tokens == 0
    prompts.encode("ab#cd#ef")
    assert prompts.reused_tokens == 5


def test_entries_are_bounded_in_number_and_characters() -> None:
    prompts = PromptTokens(_CharTokenizer().encode, {0}, entries=3, max_chars=40, least=1)
    for i in range(5):
        prompts.encode(f"{i}#" + "z" * 10)
    assert len(prompts._entries) == 3
    prompts.encode("#" + "y" * 30)
    assert sum(len(t) for t in prompts._entries) <= 40


@pytest.mark.parametrize(
    ("a", "b", "n"), [("", "x", 0), ("abc", "abc", 3), ("abcd", "abxd", 2), ("ab", "abc", 2)]
)
def test_common_prefix(a: str, b: str, n: int) -> None:
    assert _common_prefix(a, b) == n == _common_prefix(b, a)
