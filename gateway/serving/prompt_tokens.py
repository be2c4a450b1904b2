"""Tokenizing a chat prompt that extends a recent one: only its new part.

A multi-turn chat's rendered prompt is the previous turn's prompt plus the
new messages, and tokenizing it whole costs every turn again: about 4 us a
token on the 2-core CPU here (a 13,000-token conversation 45-65 ms), 4-5 ms
of a 2,000-token turn's queue time on the H200's host (issue #12's warm
shared-prefix turn). HF tokenizers split a text at its added tokens (the
chat template's markers) before anything else and tokenize the pieces
between them independently. So a prompt that shares a prefix with a recent
one reuses that one's ids up to the last added token wholly inside the
shared prefix and tokenizes from that token on, the token included (the
tokenizer then sees the split it would see in the whole text, and a
"prepend to the first piece" normalizer does not take the tail for a text's
start).

The first `verify` reuses also tokenize the whole text and compare; one
mismatch (a tokenizer whose pieces are not independent after all) turns
reuse off for the process, with a warning. Given `check_later` (the
gateway's Frontend gives it a thread of its own), those comparisons run
there, after the reused ids went out: a request does not pay for tokenizing
its prompt twice (the benchmark's shared-prefix scenario has 12 warm turns,
the first 4 of which were checked on the request's path). Until a check
fails, a reused prompt's ids are a tokenization of the same text, whether
or not the canonical one. Entries are bounded in number and in characters.

Threading: `encode` runs on the tokenizer pool's threads, checks on
`check_later`'s; one lock guards the entries and counters, never held while
tokenizing.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("mlxd.gateway.tokenizer")


@dataclass(frozen=True, slots=True)
class _Entry:
    ids: np.ndarray  # int32: a cached prompt's ids take 4 bytes each, not a Python int's 28+
    ends: list[int]  # each added token's end in the text, ascending
    starts: list[int]  # its start
    index: list[int]  # its position in `ids`


class PromptTokens:
    """Token ids of prompt texts, reusing a recent text's ids for a shared prefix."""

    def __init__(
        self,
        encode: Callable[[str], Any],
        added_ids: Collection[int],
        *,
        entries: int = 32,
        max_chars: int = 2_000_000,
        verify: int = 4,
        least: int = 64,
        check_later: Callable[[Callable[[], object]], object] | None = None,
    ) -> None:
        """`encode`: text -> a `tokenizers.Encoding` (its ids, and character
        offsets by `token_to_chars`), without special tokens added; `added_ids`:
        the ids of the tokenizer's added tokens; `least`:
        the fewest ids worth reusing (two chats sharing only the template's
        first marker are tokenized whole, and spend no check); `check_later`:
        runs a check elsewhere (module doc), None: on the caller's thread."""
        self._encode = encode
        self._added_ids = np.asarray(sorted(added_ids), dtype=np.int32)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._limit, self._max_chars, self._chars = entries, max_chars, 0
        self._verify, self._least = verify, least
        self._check_later = check_later
        self.checks_failed = 0
        self._lock = threading.Lock()
        self.reused_tokens = 0  # ids taken from an earlier prompt instead of tokenized
        self.enabled = True

    def encode(self, text: str) -> list[int]:
        with self._lock:
            if self.enabled and (same := self._entries.get(text)) is not None:
                self._entries.move_to_end(text)
                self.reused_tokens += len(same.ids)
                return list(same.ids.tolist())
            found = self._nearest(text) if self.enabled else None
        extended = self._extend(text, *found) if found is not None else None
        if extended is not None and self._check(text, extended[0]):
            ids, entry, reused = extended
            with self._lock:
                self.reused_tokens += reused
        else:
            ids, entry = self._whole(text)
        with self._lock:
            self._keep(text, entry)
        return ids

    def _whole(self, text: str) -> tuple[list[int], _Entry]:
        entry = self._entry(self._encode(text), 0, np.empty(0, dtype=np.int32))
        return entry.ids.tolist(), entry

    def _entry(self, enc: Any, shift: int, head: np.ndarray) -> _Entry:
        """An entry from `enc` (the text from character `shift` on) after the ids
        `head`. Only the added tokens' offsets are asked for: all of them would
        cost more than the tokenizing saved on a few thousand tokens."""
        ids = np.asarray(enc.ids, dtype=np.int32)
        found = np.flatnonzero(np.isin(ids, self._added_ids))
        spans = [enc.token_to_chars(int(i)) for i in found]
        return _Entry(
            np.concatenate([head, ids]),
            [e + shift for _, e in spans],
            [s + shift for s, _ in spans],
            [int(i) + len(head) for i in found],
        )

    def _nearest(self, text: str) -> tuple[_Entry, int, int] | None:
        """The entry sharing the longest prefix with `text` through one of its
        added tokens: (entry, ids reused, where the tail starts); None if none."""
        best: tuple[str, _Entry, int, int] | None = None
        for old, entry in self._entries.items():
            shared = _common_prefix(old, text)
            k = bisect.bisect_right(entry.ends, shared) - 1  # the last token inside it
            # Tokenized again from that token on: an added token ending just at
            # the shared prefix's end may be the start of a longer one here.
            reused = entry.index[k] if k >= 0 else 0
            if reused >= self._least and (best is None or reused > best[2]):
                best = (old, entry, reused, entry.starts[k])
        if best is None:
            return None
        self._entries.move_to_end(best[0])
        return best[1:]

    def _extend(
        self, text: str, entry: _Entry, reused: int, start: int
    ) -> tuple[list[int], _Entry, int] | None:
        """The ids of `text`: `entry`'s first `reused`, then `text` tokenized from
        character `start` on (and the entry for them, and `reused`); None if that
        does not start with the same token."""
        enc = self._encode(text[start:])
        if not enc.ids or enc.ids[0] != entry.ids[reused]:
            return None
        tail = self._entry(enc, start, entry.ids[:reused])
        # The head's marks before the reused token, then the tail's own.
        k = bisect.bisect_left(entry.index, reused)
        merged = _Entry(
            tail.ids,
            entry.ends[:k] + tail.ends,
            entry.starts[:k] + tail.starts,
            entry.index[:k] + tail.index,
        )
        return merged.ids.tolist(), merged, reused

    def _check(self, text: str, ids: list[int]) -> bool:
        """The first `verify` reuses against the whole text's tokenization: here,
        or handed to `check_later` (then `ids` stand meanwhile)."""
        with self._lock:
            if self._verify <= 0:
                return True
            self._verify -= 1
        if self._check_later is not None:
            self._check_later(lambda: self._compare(text, ids))
            return True
        return self._compare(text, ids)

    def _compare(self, text: str, ids: list[int]) -> bool:
        whole = list(self._encode(text).ids)
        if whole == ids:
            return True
        with self._lock:
            self.enabled = False
            self.checks_failed += 1
        log.warning("prompt token reuse is off: this tokenizer's pieces are not independent")
        return False

    def _keep(self, text: str, entry: _Entry) -> None:
        if len(text) > self._max_chars or not entry.ends:
            return
        if text in self._entries:
            self._entries.move_to_end(text)
            return
        self._entries[text] = entry
        self._chars += len(text)
        while len(self._entries) > self._limit or self._chars > self._max_chars:
            old, _ = self._entries.popitem(last=False)
            self._chars -= len(old)


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
