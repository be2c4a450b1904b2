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
    # paced: a full width of new prompts may share the chunk budget (the core
    # applies it), but none while another prompt is still prefilling
    assert s.prefill_slots(running=3, prefilling=0, decoding=3) == 1  # batch room: 1
    assert s.prefill_slots(running=3, prefilling=1, decoding=2) == 0
    assert s.prefill_slots(running=4, prefilling=0, decoding=4) == 0  # batch full
    unpaced: Scheduler[int] = Scheduler(SchedulerConfig(max_batch=8, prefill_batch=3, pacing=False))
    for i in range(10):
        unpaced.push(str(i), i)
    assert unpaced.prefill_slots(running=3, prefilling=0, decoding=3) == 3


def test_paced_prompts_wait_for_the_current_prefill() -> None:
    s: Scheduler[int] = Scheduler(SchedulerConfig(max_batch=16, prefill_batch=4))
    for i in range(10):
        s.push(str(i), i)
    assert s.prefill_slots(running=2, prefilling=0, decoding=2) == 4
    assert s.prefill_slots(running=3, prefilling=1, decoding=2) == 0


def test_chunk_size_full_when_idle_and_controlled_when_decoding() -> None:
    cfg = SchedulerConfig(
        prefill_chunk=2048, pacing_factor=2.0, min_chunk=16, initial_paced_chunk=256
    )
    s: Scheduler[int] = Scheduler(cfg)
    assert s.chunk_size(decoding=0) == 2048
    assert s.chunk_size(decoding=4) == 256
    s.observe_step(0.010, decoding=4, prompt_tokens=0)  # steady decode: 10 ms
    s.observe_step(0.015, decoding=4, prompt_tokens=256)  # within 2x: grow
    assert s.chunk_size(decoding=4) == 512
    s.observe_step(0.050, decoding=4, prompt_tokens=512)  # too slow: shrink
    assert s.chunk_size(decoding=4) == 256
    assert s.chunk_size(decoding=0) == 2048
    assert Scheduler(SchedulerConfig(pacing=False)).chunk_size(decoding=8) == 2048


def test_paced_chunks_shrink_while_it_helps() -> None:
    s: Scheduler[int] = Scheduler(SchedulerConfig(prefill_chunk=1000, min_chunk=16))
    s.observe_step(0.001, decoding=1, prompt_tokens=0)
    for _ in range(30):
        # compute-bound: cost proportional to the chunk, always over budget
        s.observe_step(0.01 * s.paced_chunk, decoding=1, prompt_tokens=s.paced_chunk)
    assert s.chunk_size(decoding=1) == 16
    for _ in range(20):  # full chunks are fast again: grow
        s.observe_step(0.0001, decoding=1, prompt_tokens=s.paced_chunk)
    assert s.chunk_size(decoding=1) == 512  # the largest power of two <= 1000


def test_steps_with_a_short_prompt_do_not_steer_the_chunk() -> None:
    """A step that prefilled a few tokens says nothing about a full chunk's cost."""
    s: Scheduler[int] = Scheduler(
        SchedulerConfig(prefill_chunk=2048, min_chunk=16, initial_paced_chunk=64)
    )
    s.observe_step(0.010, decoding=4, prompt_tokens=0)  # steady decode 10 ms
    for _ in range(10):
        s.observe_step(0.011, decoding=4, prompt_tokens=20)  # cheap, but 20 < 64 / 2
    assert s.chunk_size(decoding=4) == 64 and not s.chunk_cost
    s.observe_step(0.011, decoding=4, prompt_tokens=40)  # most of a chunk: it counts
    assert s.chunk_size(decoding=4) == 128


def test_overhead_bound_chunks_grow_to_the_knee() -> None:
    """When every chunk size costs the same (a fixed per-pass cost, as on a GPU),
    shrinking buys nothing: the controller settles on big chunks instead."""
    s: Scheduler[int] = Scheduler(
        SchedulerConfig(prefill_chunk=2048, min_chunk=16, initial_paced_chunk=256)
    )
    s.observe_step(0.010, decoding=4, prompt_tokens=0)  # steady decode 10 ms
    seen = set()
    for _ in range(40):
        c = s.paced_chunk
        seen.add(c)
        s.observe_step(0.022 + (0.05 if c >= 2048 else 0.0), decoding=4, prompt_tokens=c)
    assert all(c & (c - 1) == 0 for c in seen)
    assert s.chunk_size(decoding=4) >= 512  # not stuck at the minimum
    assert s.chunk_size(decoding=4) <= 1024  # 2048 costs more: the knee is below it
