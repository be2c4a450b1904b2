"""Unit tests of the scheduler's pure logic (admission order, pacing arithmetic)."""

from worker.scheduler import BATCH, INTERACTIVE, Scheduler, SchedulerConfig


def test_fifo_within_priority_and_interactive_first() -> None:
    s: Scheduler[str] = Scheduler(SchedulerConfig())
    s.push("b1", "b1", BATCH)
    s.push("i1", "i1", INTERACTIVE)
    s.push("b2", "b2", BATCH)
    s.push("i2", "i2", INTERACTIVE)
    assert [s.pop() for _ in range(4)] == ["i1", "i2", "b1", "b2"]
    assert s.waiting() == 0


def test_remove_waiting_request() -> None:
    s: Scheduler[str] = Scheduler(SchedulerConfig())
    s.push("a", "A")
    s.push("b", "B")
    assert s.remove("a") == "A"
    assert s.remove("a") is None
    assert s.pop() == "B"


def test_prefill_slots_respect_batch_and_pacing() -> None:
    s: Scheduler[int] = Scheduler(SchedulerConfig(max_batch=4, prefill_batch=3))
    for i in range(10):
        s.push(str(i), i)
    assert s.prefill_slots(running=0, prefilling=0, decoding=0) == 3
    assert s.prefill_slots(running=3, prefilling=0, decoding=3) == 1  # paced: one at a time
    assert s.prefill_slots(running=3, prefilling=1, decoding=2) == 0
    assert s.prefill_slots(running=4, prefilling=0, decoding=4) == 0  # batch full
    unpaced: Scheduler[int] = Scheduler(SchedulerConfig(max_batch=8, prefill_batch=3, pacing=False))
    for i in range(10):
        unpaced.push(str(i), i)
    assert unpaced.prefill_slots(running=3, prefilling=0, decoding=3) == 3


def test_chunk_size_full_when_idle_and_paced_when_decoding() -> None:
    cfg = SchedulerConfig(
        prefill_chunk=2048, pacing_factor=2.0, min_chunk=32, initial_paced_chunk=128
    )
    s: Scheduler[int] = Scheduler(cfg)
    assert s.chunk_size(decoding=0) == 2048
    assert s.chunk_size(decoding=4) == 128  # no measurements yet
    # steady decode 10 ms; prefill 0.1 ms/token -> 10 ms buys 100 tokens
    for _ in range(20):
        s.observe_step(0.010, decoding=4, prompt_tokens=0)
        s.observe_step(0.010 + 0.0001 * 200, decoding=4, prompt_tokens=200)
    assert 90 <= s.chunk_size(decoding=4) <= 110
    assert s.chunk_size(decoding=0) == 2048
    assert Scheduler(SchedulerConfig(pacing=False)).chunk_size(decoding=8) == 2048


def test_chunk_size_is_clamped() -> None:
    s: Scheduler[int] = Scheduler(SchedulerConfig(prefill_chunk=512, min_chunk=32))
    s.observe_step(0.001, decoding=1, prompt_tokens=0)
    s.observe_step(1.0, decoding=1, prompt_tokens=10)  # very slow prefill
    assert s.chunk_size(decoding=1) == 32
    fast: Scheduler[int] = Scheduler(SchedulerConfig(prefill_chunk=512))
    fast.observe_step(1.0, decoding=1, prompt_tokens=0)
    fast.observe_step(1.0 + 1e-6 * 100, decoding=1, prompt_tokens=100)
    assert fast.chunk_size(decoding=1) == 512
