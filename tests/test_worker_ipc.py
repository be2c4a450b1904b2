"""The worker process over its real Unix socket, without the gateway.

Same semantics as the in-process core tests, plus what only a socket can show:
the handshake's checks, one frame per step, malformed frames, peer checks.
"""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import exit_codes
from protocol.frames import HEADER, MAGIC, PROTOCOL_VERSION
from protocol.messages import (
    Add,
    Hello,
    Ready,
    SamplingParams,
    StepOutputs,
    Utility,
    UtilityResult,
)
from protocol.transport import FrameReader, write_message
from tests.worker_helpers import GREEDY, TOKEN, WorkerProc, spawn_worker


@pytest.fixture
def worker(tiny_model_dir: Path, tmp_path: Path) -> Iterator[WorkerProc]:
    w = spawn_worker(tiny_model_dir, tmp_path)
    yield w
    if w.proc.poll() is None:
        w.proc.kill()
    w.proc.wait()


def generate(sock: socket.socket, prompt: list[int], n: int, rid: str = "r1") -> list[int]:
    write_message(sock, Add(rid, prompt, n, GREEDY))
    reader = FrameReader(sock)
    tokens: list[int] = []
    while True:
        msg = reader.read_message()
        assert msg is not None, "worker closed the connection"
        if isinstance(msg, StepOutputs):
            for o in msg.outputs:
                assert o.request_id == rid
                tokens += o.token_ids
                if o.finish_reason:
                    return tokens


def test_socket_is_private(worker: WorkerProc) -> None:
    sock, _ = worker.handshake()
    mode = stat.S_IMODE(os.stat(worker.socket_path).st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(Path(worker.socket_path).parent).st_mode) == 0o700
    sock.close()


def test_ready_reports_the_model_and_serves(worker: WorkerProc) -> None:
    sock, ready = worker.handshake()
    assert ready.model_id == "tiny" and ready.epoch == 1 and ready.pid == worker.proc.pid
    assert ready.context_length > 0 and ready.kv_bytes_per_token > 0 and ready.vocab_size > 0
    assert ready.eos_token_ids
    assert len(generate(sock, [5, 6, 7], 6)) <= 6
    sock.close()
    # the gateway's end closed: the worker exits by itself
    assert worker.proc.wait(30) == exit_codes.OK


@pytest.mark.parametrize(
    "hello",
    [
        Hello(PROTOCOL_VERSION, 1, "wrong-token"),
        Hello(PROTOCOL_VERSION + 1, 1, TOKEN),
        Hello(PROTOCOL_VERSION, 99, TOKEN),
    ],
)
def test_bad_handshakes_are_refused_and_the_worker_keeps_waiting(
    worker: WorkerProc, hello: Hello
) -> None:
    s = worker.connect()
    write_message(s, hello)
    assert FrameReader(s).read_message() is None  # refused: connection closed, no Ready
    s.close()
    sock, ready = worker.handshake()  # a correct gateway still gets in
    assert ready.pid == worker.proc.pid
    sock.close()


def _garbage_frames() -> list[bytes]:
    rng = random.Random(7)
    frames = [
        b"GARBAGE-NOT-A-FRAME",
        HEADER.pack(b"XXXX", PROTOCOL_VERSION, 4, 0, 3) + b"abc",
        HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, 4, 0, 1) + b"\x90",
        HEADER.pack(MAGIC, PROTOCOL_VERSION, 250, 0, 1) + b"\x90",  # unknown type
        HEADER.pack(MAGIC, PROTOCOL_VERSION, 4, 0, 2**31) + b"",  # oversize
        HEADER.pack(MAGIC, PROTOCOL_VERSION, 4, 0, 3) + b"\xc1\xc1\xc1",  # bad msgpack
        HEADER.pack(MAGIC, PROTOCOL_VERSION, 4, 0, 10) + b"\x93\xa1x",  # truncated body
    ]
    frames += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(5)]
    return frames


@pytest.mark.parametrize("frame", _garbage_frames())
def test_malformed_frames_drop_the_connection_not_the_model(
    worker: WorkerProc, frame: bytes
) -> None:
    sock, ready = worker.handshake()
    expected = generate(sock, [9, 8, 7], 5, "before")
    sock.sendall(frame)
    sock.shutdown(socket.SHUT_WR)  # a truncated frame then ends: EOF mid-frame
    # the worker drops this connection (EOF after any pending outputs)
    reader = FrameReader(sock)
    try:
        while (msg := reader.read_message()) is not None:
            assert not isinstance(msg, Ready)
    except ConnectionResetError:
        pass  # closed with our bytes unread: the kernel answers with a reset
    sock.close()
    # the process lives, keeps its model and serves a new connection identically
    sock2, ready2 = worker.handshake()
    assert ready2.pid == ready.pid and ready2.identity == ready.identity
    assert generate(sock2, [9, 8, 7], 5, "after") == expected
    assert "connection dropped" in worker.log.read_text() or frame.startswith(b"GARBAGE")
    sock2.close()


def test_utility_stats_and_unknown_method(worker: WorkerProc) -> None:
    sock, _ = worker.handshake()
    write_message(sock, Utility(1, "stats", {}))
    write_message(sock, Utility(2, "no-such-method", {}))
    reader = FrameReader(sock)
    results = {}
    while len(results) < 2:
        msg = reader.read_message()
        if isinstance(msg, UtilityResult):
            results[msg.call_id] = msg
    assert results[1].ok and results[1].result["requests"] == 0
    assert not results[2].ok and "unknown method" in results[2].error
    sock.close()


def test_an_idle_worker_gives_mlx_cached_buffers_back(worker: WorkerProc) -> None:
    """The batch's buffers stay cached for a request that follows at once, and go
    back to the system once the worker has been idle (worker/proc.py,
    IDLE_RELEASE_S); a worker that never released them would fail here."""
    sock, _ = worker.handshake()
    generate(sock, list(range(3, 200)), 8, "warm")
    reader = FrameReader(sock)
    deadline = time.monotonic() + 30
    cache = -1
    call = 0
    while cache != 0 and time.monotonic() < deadline:
        call += 1
        write_message(sock, Utility(call, "stats", {}))
        while not isinstance(msg := reader.read_message(), UtilityResult):
            pass
        cache = msg.result["memory"]["cache_bytes"]
        if cache:
            time.sleep(0.05)  # polling the worker's own clock: no event to wait on
    assert cache == 0
    sock.close()


def test_one_frame_per_step_for_a_batch(worker: WorkerProc) -> None:
    sock, _ = worker.handshake()
    for i in range(6):
        write_message(sock, Add(f"b{i}", [3 + i, 4, 5], 8, GREEDY))
    reader = FrameReader(sock)
    done: set[str] = set()
    steps: list[int] = []
    widest = 0
    while len(done) < 6:
        msg = reader.read_message()
        if isinstance(msg, StepOutputs):
            steps.append(msg.step)
            widest = max(widest, len({o.request_id for o in msg.outputs}))
            done |= {o.request_id for o in msg.outputs if o.finish_reason}
    assert len(steps) == len(set(steps)), "two frames for one engine step"
    assert widest == 6
    sock.close()


@pytest.mark.parametrize(("quiet_s", "gap_s"), [(0.0, 0.05), (0.05, 0.005)])
def test_an_idle_worker_admits_a_wave_arriving_apart_in_one_step(
    tiny_model_dir: Path, tmp_path: Path, quiet_s: float, gap_s: float
) -> None:
    """Adds that reach an idle worker a few ms apart (the wave the gateway
    submits together reaches the socket a fraction of a millisecond apart; the
    gaps here are widened for a loaded machine): with the quiet period the
    first step admits all three; without it the first request starts alone."""
    w = spawn_worker(tiny_model_dir, tmp_path, arrival_quiet_s=quiet_s)
    try:
        sock, _ = w.handshake()
        reader = FrameReader(sock)
        for i in range(3):
            write_message(sock, Add(f"w{i}", [3 + i, 4, 5, 6], 4, GREEDY))
            if i < 2:
                time.sleep(gap_s)  # the input: requests arriving apart, not a wait for an event
        first_step: dict[str, int] = {}
        while len(first_step) < 3:
            msg = reader.read_message()
            assert msg is not None
            if isinstance(msg, StepOutputs):
                for o in msg.outputs:
                    if o.token_ids:
                        first_step.setdefault(o.request_id, msg.step)
        if quiet_s:
            assert len(set(first_step.values())) == 1, first_step
        else:
            assert first_step["w0"] < first_step["w2"], first_step
        sock.close()
    finally:
        w.proc.kill()
        w.proc.wait()


def test_a_tight_budget_still_serves_and_the_worker_says_how_much_kv_it_leaves(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A budget a few MiB above the tiny model's weights (session 29's H100
    case in miniature: a 512-token pass's scratch, 16 KiB a token here, would
    take more than the budget beside the weights). The governor sets aside a
    smaller pass, so a short request is served, not rejected for memory; and
    since the KV room cannot hold the model's whole context, the worker's log
    says how many tokens it holds."""
    w = spawn_worker(tiny_model_dir, tmp_path, memory_budget_bytes=3 << 20)
    try:
        sock, ready = w.handshake()
        full_context = ready.kv_bytes_per_token * ready.context_length
        assert 0 < ready.memory_budget < full_context
        write_message(sock, Add("short", [3, 4, 5, 6], 4, GREEDY))
        reader, outs = FrameReader(sock), []
        while not any(o.finish_reason for o in outs):
            msg = reader.read_message()
            assert msg is not None
            if isinstance(msg, StepOutputs):
                outs += [o for o in msg.outputs if o.request_id == "short"]
        assert outs[-1].finish_reason == "length", outs[-1]
        assert sum(len(o.token_ids) for o in outs) == 4
        sock.close()
    finally:
        w.proc.kill()
        w.proc.wait()
    warnings = [json.loads(x) for x in w.log.read_text().splitlines() if "leaves" in x]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning", warnings
    tokens = ready.memory_budget // ready.kv_bytes_per_token
    assert f"{tokens} tokens of the model's {ready.context_length}" in warnings[0]["event"]


def test_bad_config_exits_with_its_own_code(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker",
            "--socket",
            str(tmp_path / "s"),
            "--model",
            "x",
            "--max-batch",
            "0",
        ],
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == exit_codes.BAD_CONFIG
    r = subprocess.run(
        [sys.executable, "-m", "worker", "--bogus-flag"], capture_output=True, timeout=60
    )
    assert r.returncode == exit_codes.BAD_CONFIG


def test_model_load_failure_exits_with_its_own_code_after_telling_the_gateway(
    tmp_path: Path,
) -> None:
    from protocol.messages import Failed

    w = spawn_worker(tmp_path / "missing-model", tmp_path)
    s = w.connect()
    write_message(s, Hello(PROTOCOL_VERSION, 1, TOKEN))
    msg = FrameReader(s).read_message()
    assert isinstance(msg, Failed) and msg.exit_code == exit_codes.MODEL_LOAD
    assert "config.json" in msg.reason
    assert w.proc.wait(30) == exit_codes.MODEL_LOAD


def test_poison_adds_are_rejected_and_the_worker_serves_on(worker: WorkerProc) -> None:
    """Issue 13, findings 1 and 4 over the real socket: each poison Add is one
    rejected request; the connection, the process and a neighbour's stream live on."""
    sock, ready = worker.handshake()
    poison = {
        "digits": SamplingParams(logit_bias={"9" * 5001: 1.0}),
        "superscript": SamplingParams(logit_bias={"\u00b2": 1.0}),
        "arabic-indic": SamplingParams(logit_bias={"\u0661": 1.0}),
        "nan": SamplingParams(temperature=float("nan")),
    }
    write_message(sock, Add("other", [5, 6, 7], 24, GREEDY))
    for rid, sampling in poison.items():
        write_message(sock, Add(rid, [1, 2], 4, sampling))
    cycle = '{"grammar": "start: a\\na: b\\nb: a"}'
    write_message(sock, Add("grammar", [1, 2], 4, GREEDY, constraint=cycle))
    reader = FrameReader(sock)
    finished: dict[str, str] = {}
    while len(finished) < len(poison) + 2:
        msg = reader.read_message()
        assert msg is not None, "worker closed the connection"
        if isinstance(msg, StepOutputs):
            finished |= {o.request_id: o.finish_reason for o in msg.outputs if o.finish_reason}
    assert {finished[rid] for rid in [*poison, "grammar"]} == {"rejected"}
    assert finished["other"] in ("length", "stop")
    assert worker.proc.poll() is None and ready.pid == worker.proc.pid
    assert len(generate(sock, [9, 8, 7], 4, "after")) <= 4
    sock.close()


class _StubCore:
    """Just enough of EngineCore for Worker._dispatch: accepts every Add."""

    def __init__(self) -> None:
        self.requests: dict[str, Add] = {}

    def add(self, msg: Add) -> None:
        self.requests[msg.request_id] = msg

    def abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.requests.pop(rid, None)


@pytest.mark.parametrize("group", [False, True])
def test_dispatch_keeps_no_commands_without_a_group(group: bool) -> None:
    # A lone worker once appended every Add and Abort to the list meant for a
    # group's other ranks, which only a group round empties: the worker's memory
    # grew by every request it served (issue 13, finding 11).
    from protocol.messages import Abort
    from protocol.worker_config import WorkerConfig
    from worker.proc import Worker

    w = Worker(WorkerConfig(socket="", model="unused"))
    w.link = object() if group else None
    core, forward = _StubCore(), []  # type: ignore[var-annotated]
    for i in range(3):
        w._dispatch(Add(f"r{i}", [1, 2], 4, GREEDY), None, core, forward)  # type: ignore[arg-type]
    w._dispatch(Abort(["r0"]), None, core, forward)  # type: ignore[arg-type]
    assert len(forward) == (4 if group else 0)


def test_the_step_trace_records_every_step_the_worker_ran(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`step_trace`: one JSON line per engine step, warm-up marked, written once
    the worker goes idle (EngineCore.idle, before it waits for work) and by the
    time it exits; the prompt's tokens and the tokens served add up."""
    trace_dir = tmp_path / "steps"
    w = spawn_worker(tiny_model_dir, tmp_path, step_trace=str(trace_dir))
    try:
        sock, _ = w.handshake()
        tokens = generate(sock, list(range(3, 40)), 5)
        # No event says the worker went idle: its file is what shows it.
        deadline = time.monotonic() + 10
        while not any('"warmup":false' in f.read_text() for f in trace_dir.glob("steps-*.jsonl")):
            assert time.monotonic() < deadline, "the idle worker wrote no served step"
            time.sleep(0.05)
        assert w.proc.poll() is None  # written while it serves, not at its exit
        sock.close()
        assert w.proc.wait(30) == exit_codes.OK
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
    files = list(trace_dir.glob("steps-*.jsonl"))
    assert [f.name for f in files] == [f"steps-{w.proc.pid}.jsonl"]
    steps = [json.loads(line) for line in files[0].read_text().splitlines()]
    served = [s for s in steps if not s["warmup"]]
    assert any(s["warmup"] for s in steps) and served
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    # The prompt's last token may be the first decode step's input (mlx-lm's
    # own pass over it), so the passes cover 36 or 37 of its 37 tokens.
    assert sum(s["prompt_tokens"] for s in served) in (36, 37)
    assert sum(s["admitted"] for s in served) == 1
    assert len(served) >= len(tokens)
    for s in served:
        assert s["s"] > 0 and s["chunk"] > 0 and s["fused"] is False  # two passes on the CPU
        assert (s["admit_s"] > 0) == (s["admitted"] > 0)
        assert s["scratch_mib"] >= 0
    assert any(s["scratch_mib"] > 0 for s in served if s["prompt_tokens"])  # a pass's activations


def test_a_step_trace_it_cannot_write_leaves_the_worker_serving(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A `step_trace` that names a file, not a directory: the worker logs why the
    trace is off and serves as usual (a diagnostic never stops it)."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    w = spawn_worker(tiny_model_dir, tmp_path, step_trace=str(blocker))
    try:
        sock, _ = w.handshake()
        assert len(generate(sock, [5, 6, 7], 4)) <= 4
        sock.close()
        assert w.proc.wait(30) == exit_codes.OK
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
    assert "step trace off" in w.log.read_text()
    assert blocker.read_text() == "x"
