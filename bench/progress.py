"""A dependency-free progress display on stderr.

Owns only presentation: one line per step (target and scenario), redrawn in
place with a bar when stderr is a terminal, otherwise printed once when the
step ends (so CI logs stay readable).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self, total_steps: int, stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total_steps = max(1, total_steps)
        self.step = 0
        self.label = ""
        self.total = 0
        self.done = 0
        self.started = time.monotonic()
        self.step_started = self.started
        self._last_draw = 0.0

    def begin(self, label: str, total: int) -> None:
        self.step += 1
        self.label, self.total, self.done = label, max(1, total), 0
        self.step_started = time.monotonic()
        self._draw(force=True)

    def tick(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    def end(self, note: str = "") -> None:
        self.done = self.total
        if not self.enabled:
            return
        took = time.monotonic() - self.step_started
        line = f"[{self.step}/{self.total_steps}] {self.label}: done in {took:.1f}s"
        if note:
            line += f" ({note})"
        if self.tty:
            self.stream.write("\r\033[K" + line + "\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, msg: str) -> None:
        if not self.enabled:
            return
        self.stream.write(("\r\033[K" if self.tty else "") + msg + "\n")
        self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if not (self.enabled and self.tty):
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(
            f"\r\033[K[{self.step}/{self.total_steps}] {self.label} [{bar}] "
            f"{self.done}/{self.total} {now - self.step_started:.1f}s "
            f"(total {now - self.started:.0f}s)"
        )
        self.stream.flush()
