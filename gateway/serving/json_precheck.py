"""Large request bodies are parsed first in a helper process, off the event loop.

`json.loads` and validation hold the GIL, so a thread would not free the event
loop: a 5 MB body of 400,000 small values kept it busy for 0.55 s. A body of
`THRESHOLD_BYTES` or more is therefore parsed first in one spawned helper
process (gateway/serving/json_inspect.py), which counts its JSON values; one
over `max_json_values`, or invalid JSON, is refused with a 400 before the event
loop parses anything. What passes is parsed again on the loop, where it now
costs little: a large body within the bound is mostly long strings (a prompt),
which parse at memory speed. The helper is started on the first large body,
dies with the gateway, and is replaced if it dies.

Threading: event loop only (the helper runs json_inspect.inspect).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gateway.http.errors import APIError
from gateway.serving import json_inspect

log = logging.getLogger("mlxd.gateway.json_precheck")

THRESHOLD_BYTES = 1 << 20


class JsonPrecheck:
    """The helper process and the refusal rules; one per app (gateway/http/app_keys)."""

    def __init__(self, max_values: int, threshold_bytes: int = THRESHOLD_BYTES) -> None:
        self.max_values = max_values
        self.threshold_bytes = threshold_bytes
        self._pool: ProcessPoolExecutor | None = None

    def _helper(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                # spawn: forking a process with an event loop and threads is unsafe.
                mp_context=multiprocessing.get_context("spawn"),
                initializer=json_inspect.init_child,
            )
        return self._pool

    async def check(self, raw: bytes) -> None:
        """A 400 for a large body that is not JSON or has too many values; else nothing."""
        if len(raw) < self.threshold_bytes:
            return
        loop = asyncio.get_running_loop()
        try:
            verdict, detail = await loop.run_in_executor(
                self._helper(), json_inspect.inspect, raw, self.max_values
            )
        except BrokenProcessPool:
            self._pool = None  # the helper died (killed?): the next large body starts one
            log.warning("the JSON helper process died; parsing this body on the event loop")
            return
        if verdict == "invalid":
            raise APIError(400, f"the request body is not valid JSON: {detail}")
        if verdict == "deep":
            raise APIError(400, "the request body is nested too deeply")
        if verdict == "too_many":
            raise APIError(
                400,
                f"the request body has more than {self.max_values} JSON values (keys, items "
                "and scalars); this server parses at most that many",
            )

    def shutdown(self) -> None:
        """Stop the helper (app cleanup)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
