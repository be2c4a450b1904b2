"""The request ledger (worker/request_ledger.py): an abort is confirmed by the
reader thread at once, and nothing the engine sends for the request after that
reaches the gateway. Pure tests of the ledger, then the real worker process,
whose Abort arrives while a long prefill step runs."""

from __future__ import annotations

import socket
from pathlib import Path

from protocol.messages import (
    Abort,
    Add,
    Heartbeat,
    RequestOutput,
    StepOutputs,
    Utility,
    UtilityResult,
)
from protocol.transport import FrameReader, write_message
from tests.worker_helpers import GREEDY, spawn_worker
from worker.request_ledger import RequestLedger


def _ledger() -> tuple[RequestLedger, list[StepOutputs]]:
    sent: list[StepOutputs] = []
    return RequestLedger(7, sent.append), sent


def _outputs(sent: list[StepOutputs]) -> list[tuple[str, list[int], str | None]]:
    return [(o.request_id, o.token_ids, o.finish_reason) for m in sent for o in m.outputs]


def test_an_abort_is_confirmed_once_and_what_the_engine_sends_after_it_is_dropped() -> None:
    ledger, sent = _ledger()
    ledger.opened("a")
    ledger.opened("b")
    ledger.send_outputs(StepOutputs(7, 3, [RequestOutput("a", [5]), RequestOutput("b", [6])]))
    assert ledger.abort(["a", "a"]) == ["a"]
    # The step in flight ends: its token for "a", then the engine's own "abort".
    ledger.send_outputs(StepOutputs(7, 4, [RequestOutput("a", [9]), RequestOutput("b", [8])]))
    ledger.send_outputs(StepOutputs(7, 4, [RequestOutput("a", [], "abort")]))
    assert _outputs(sent) == [
        ("a", [5], None),
        ("b", [6], None),
        ("a", [], "abort"),
        ("b", [8], None),
    ]
    assert [m.step for m in sent] == [3, 3, 4]  # the confirmation carries the last step sent
    assert all(m.epoch == 7 for m in sent)
    assert ledger.open_count() == 1


def test_a_request_that_already_ended_gets_no_second_end() -> None:
    ledger, sent = _ledger()
    ledger.opened("a")
    ledger.send_outputs(StepOutputs(7, 1, [RequestOutput("a", [5], "stop")]))
    assert ledger.abort(["a"]) == []
    assert ledger.abort(["never-sent"]) == []
    assert _outputs(sent) == [("a", [5], "stop")]
    assert ledger.open_count() == 0


def test_an_abort_that_overtakes_its_add_ends_the_request_before_the_engine_sees_it() -> None:
    ledger, sent = _ledger()
    ledger.opened("a")  # read by the reader thread; the engine has not taken it yet
    assert ledger.abort(["a"]) == ["a"]
    # The engine takes the Add (and rejects it, say), then the Abort.
    ledger.send_outputs(StepOutputs(7, 0, [RequestOutput("a", [], "rejected", error="bad")]))
    ledger.send_outputs(StepOutputs(7, 0, [RequestOutput("a", [], "abort")]))
    assert _outputs(sent) == [("a", [], "abort")]


def test_frames_with_only_dropped_outputs_are_not_sent() -> None:
    ledger, sent = _ledger()
    ledger.send_outputs(StepOutputs(7, 1, [RequestOutput("unknown", [1])]))
    assert sent == []


def _read_until(reader: FrameReader, want: type) -> object:
    while True:
        msg = reader.read_message()
        assert msg is not None, "the worker closed the connection"
        if isinstance(msg, want):
            return msg


def test_the_worker_confirms_an_abort_while_the_step_that_prefills_it_runs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A 2,000-token prompt in one chunk is one step of about 2 s on this CPU,
    and it would produce the request's first (and, with max_tokens 1, last)
    token. The Abort sent while that step runs is confirmed before it ends:
    the request's only output is its abort, the confirmation carries the step
    number from before the step, and the worker keeps nothing of it and serves on."""
    w = spawn_worker(
        tiny_model_dir,
        tmp_path,
        prefill_chunk=2048,
        chunk_buckets="2048",
        heartbeat_s=0.01,
        pacing_calibration_s=0.0,
    )
    try:
        sock, _ = w.handshake()
        reader = FrameReader(sock)
        write_message(sock, Add("long", [3 + i % 400 for i in range(2000)], 1, GREEDY))
        while True:  # until the step that admitted it is running
            beat = _read_until(reader, Heartbeat)
            assert isinstance(beat, Heartbeat)
            if beat.active:
                break
        write_message(sock, Abort(["long"]))
        mine: list[tuple[int, RequestOutput]] = []
        write_message(sock, Add("next", [3, 4, 5], 2, GREEDY))
        finished: set[str] = set()
        while "next" not in finished:
            msg = _read_until(reader, StepOutputs)
            assert isinstance(msg, StepOutputs)
            for o in msg.outputs:
                if o.request_id == "long":
                    mine.append((msg.step, o))
                if o.finish_reason:
                    finished.add(o.request_id)
        assert [(o.token_ids, o.finish_reason) for _, o in mine] == [([], "abort")]
        assert mine[0][0] <= beat.step, "confirmed only after the long step ended"
        write_message(sock, Utility(1, "stats"))
        stats = _read_until(reader, UtilityResult)
        assert isinstance(stats, UtilityResult) and stats.ok
        # Nothing of it is left: the row went, and the reservation with it.
        assert stats.result["requests"] == stats.result["active"] == 0
        assert stats.result["governor"]["reserved_requests"] == 0
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    finally:
        w.proc.kill()
        w.proc.wait()


def test_a_confirmation_waits_for_a_full_outbox_but_not_past_the_connections_end() -> None:
    """The reader thread puts the confirmation itself: with a gateway that stopped
    reading it waits (backpressure), and once the connection ends it returns,
    so the reader can see its socket close."""
    import queue
    import threading

    from protocol.worker_config import WorkerConfig
    from worker.proc import Connection

    a, b = socket.socketpair()
    conn = Connection(a, WorkerConfig(socket="unused", model="unused", epoch=3), queue.Queue())
    conn.outbox = queue.Queue(maxsize=1)
    conn.outbox.put("a frame the writer never takes")
    conn.ledger.opened("r")
    done = threading.Event()
    reader = threading.Thread(target=lambda: (conn.ledger.abort(["r"]), done.set()))
    reader.start()
    assert not done.wait(0.3), "it dropped the confirmation instead of waiting"
    conn.closed.set()
    assert done.wait(5.0), "it kept waiting after the connection ended"
    reader.join()
    a.close()
    b.close()
