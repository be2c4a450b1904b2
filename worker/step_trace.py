"""The worker's optional step trace: one JSON line per engine step, for diagnosis.

Off unless `WorkerConfig.step_trace` names a directory; the worker then
writes `steps-<pid>.jsonl` there (a restarted worker, or another model's,
writes its own file). Each line is one step as the engine ran it: when it
ended (`t`, CLOCK_MONOTONIC seconds, the clock the benchmark's client and
the gateway's trace use), how long `Runner.step` took (`s`), what the cost
model predicted for it (`predicted_s`), the decoding rows, the prompt tokens
and the planned chunk, the prefill pass's shape (`pass_tokens`, `kv`, and `pass_chunk`, the
length every row is padded to: the cost model's third input, which
bench/cost_replay.py needs to replay a trace),
newcomers admitted, whether the decode rows and the chunk shared one
pass (`fused`), and the memory the step allocated above what was live
before it (`scratch_mib`: a step that copies the decode batch's KV, a
join or a growth, shows it). The GPU runs of issue #12 had only the clients' gaps to read
a paced step from: which chunk the planner chose and what it expected are
what tell a cost model's error from a step's own cost.

Lines are buffered and written when the engine goes idle or the trace
closes, so a busy step pays no system call; a worker killed mid-run loses
its unwritten tail.

Threading: engine thread only (`record`, `flush`, `close`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("mlxd.worker.step_trace")

# Unwritten lines kept before a busy engine writes them anyway (about 200 bytes each).
_MAX_BUFFERED = 4096


class StepTrace:
    def __init__(self, directory: str | Path) -> None:
        path = Path(directory).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"steps-{os.getpid()}.jsonl"
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._lines: list[str] = []

    def record(self, **fields: Any) -> None:
        self._lines.append(json.dumps(fields, separators=(",", ":")))
        if len(self._lines) >= _MAX_BUFFERED:
            self.flush()

    def flush(self) -> None:
        if self._lines and self._file is not None:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def open_step_trace(directory: str) -> StepTrace | None:
    """The trace `WorkerConfig.step_trace` asks for; None when it is off, or
    when its directory cannot be written: a diagnostic must not stop the
    worker from serving (the reason is logged)."""
    if not directory:
        return None
    try:
        return StepTrace(directory)
    except OSError as e:
        log.warning("step trace off: cannot write to %s: %s", directory, e)
        return None
