"""Helpers for tests of the worker: a real worker process over its socket, and the
in-process engine driven to completion. Test modules import these from here, never
from one another.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.frames import PROTOCOL_VERSION
from protocol.messages import Hello, Ready, RequestOutput, SamplingParams
from protocol.transport import FrameReader, write_message
from protocol.worker_config import TOKEN_ENV, WorkerConfig

if TYPE_CHECKING:
    from worker.core import EngineCore

TOKEN = "test-token-123"
GREEDY = SamplingParams(temperature=0.0)
# A two-layer llama-family block small enough to build in the test itself
# (tests/test_fused.py, tests/test_blocks.py).
SMALL_BLOCK = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=300,
)


@dataclass
class WorkerProc:
    proc: subprocess.Popen[bytes]
    socket_path: str
    log: Path

    def connect(self, timeout_s: float = 60.0) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = timeout_s
        while True:
            try:
                s.connect(self.socket_path)
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc.poll() is not None:
                    raise RuntimeError(self.log.read_text()) from None
                deadline -= 0.05
                if deadline <= 0:
                    raise
                import time

                time.sleep(0.05)  # the socket file appears once the process runs

    def handshake(self, token: str = TOKEN, epoch: int = 1) -> tuple[socket.socket, Ready]:
        s = self.connect()
        write_message(s, Hello(PROTOCOL_VERSION, epoch, token))
        msg = FrameReader(s).read_message()
        assert isinstance(msg, Ready), msg
        return s, msg


def spawn_worker(model_dir: Path, tmp: Path, **cfg: object) -> WorkerProc:
    sock_dir = tmp / "sock"
    sock_dir.mkdir(mode=0o700)
    path = str(sock_dir / "w.sock")
    knobs = {"prefill_chunk": 256} | cfg
    config = WorkerConfig(
        socket=path,
        model=str(model_dir),
        model_id="tiny",
        epoch=1,
        **knobs,  # type: ignore[arg-type]
    )
    log = tmp / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", *config.to_argv()],
        env=dict(os.environ, **{TOKEN_ENV: TOKEN}),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    return WorkerProc(proc, path, log)


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    compiled = threading.Event()
    core.on_compiled = compiled.set  # as the worker's engine loop does
    for _ in range(max_steps):
        if not core.has_work():
            return outs
        if not core.needs_step():  # only grammars compiling: wait for one (or its time limit)
            compiled.wait(0.1)
            compiled.clear()
        step = core.step()
        if step is not None:
            for o in step.outputs:
                outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("requests did not finish")


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]
