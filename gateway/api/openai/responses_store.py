"""The Responses API's stored responses: an in-memory store with a byte budget and a TTL.

A response created with `store` (the default) is kept here so that a later request
can continue it (`previous_response_id`) and `GET`/`DELETE /v1/responses/{id}` can
find it. Each entry holds the response object and the conversation it ended
(every input item so far plus its own output items), both as the JSON bytes that
were or will be sent, so the budget counts the bytes actually held. An entry
carries its whole conversation rather than a link to its predecessor: evicting an
old response never breaks a newer one that continued it.

- Visibility: an entry belongs to the API key label that created it (None when
  the server has no keys, and then every client sees every entry). Another key's
  lookup finds nothing, exactly as for an unknown id, so ids leak nothing.
- Budget: `responses_store_bytes`; past it the oldest entries are evicted first.
  An entry larger than the whole budget is not stored. 0 stores nothing.
- TTL: `responses_ttl_s` from creation; expired entries are dropped on the next
  access of the store.

Threading: event loop only (no locks: every method runs to completion without
awaiting).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: str | None  # the creating key's label; None: no keys configured
    response: bytes  # the response object (JSON)
    context: bytes  # the conversation: input items then output items (a JSON list)
    expires_at: float

    @property
    def nbytes(self) -> int:
        return len(self.response) + len(self.context)

    def items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = json.loads(self.context)
        return items


class ResponseStore:
    """Stored responses by id, oldest first (creation order is eviction order)."""

    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0
        self.evicted = 0  # entries dropped for the budget (not expiry, not deletion)

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, response_id: str, owner: str | None, response: dict[str, Any], context: list[Any]
    ) -> bool:
        """Store one response; False when it is larger than the whole budget."""
        entry = StoredResponse(owner, dumps(response), dumps(context), self._clock() + self.ttl_s)
        self._expire()
        if entry.nbytes > self.max_bytes:
            return False
        self._drop(response_id)
        while self._entries and self.nbytes + entry.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        self._entries[response_id] = entry
        self.nbytes += entry.nbytes
        return True

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The entry if it exists, has not expired and belongs to `owner`."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def _expire(self) -> None:
        # Creation order is expiry order (one TTL for all), so the oldest go first.
        now = self._clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.expires_at > now:
                return
            self._drop(oldest_id)


RESPONSE_STORE: web.AppKey[ResponseStore] = web.AppKey("response_store")
