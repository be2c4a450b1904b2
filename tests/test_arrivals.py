"""The arrival window (gateway/serving/arrivals.py): its logic in pure asyncio, then
one wave through a real gateway and worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from gateway.serving.arrivals import ArrivalGate
from tests.helpers import greedy_chat_body, start_server, stop_server


async def _prepare_then_pass(
    gate: ArrivalGate, prepare_s: float, idle: bool, released: list[tuple[int, float]], i: int
) -> None:
    with gate.preparing():
        await asyncio.sleep(prepare_s)  # stands in for tokenization in the pool
    await gate.pass_through(worker_idle=idle)
    released.append((i, time.monotonic()))


async def test_a_wave_at_an_idle_worker_leaves_the_gate_together() -> None:
    gate = ArrivalGate(window_s=1.0)
    released: list[tuple[int, float]] = []
    start = time.monotonic()
    await asyncio.gather(
        *(_prepare_then_pass(gate, 0.01 * (i + 1), True, released, i) for i in range(4))
    )
    times = [t for _, t in released]
    # nobody left before the last one was prepared, and all left at once
    assert min(times) - start >= 0.04
    assert max(times) - min(times) < 0.01
    # The last one found nothing left being prepared but joined the open window:
    # it did not overtake the wave (reaching the worker alone, a step ahead).
    assert [i for i, _ in released] == [0, 1, 2, 3]
    assert gate.held == 4


async def test_a_lone_request_and_a_busy_worker_never_wait() -> None:
    gate = ArrivalGate(window_s=10.0)
    t = time.monotonic()
    await gate.pass_through(worker_idle=True)  # nothing else being prepared
    with gate.preparing():
        await gate.pass_through(worker_idle=False)  # busy: the worker batches it anyway
    assert time.monotonic() - t < 0.5 and gate.held == 0


async def test_the_window_is_bounded_by_window_s() -> None:
    gate = ArrivalGate(window_s=0.05)
    with gate.preparing():  # a request that is still being prepared when the window ends
        t = time.monotonic()
        await gate.pass_through(worker_idle=True)
        assert 0.04 <= time.monotonic() - t < 1.0
    assert gate.held == 1


async def test_a_cancelled_waiter_does_not_end_the_window_for_the_others() -> None:
    gate = ArrivalGate(window_s=1.0)
    with gate.preparing():
        leaving = asyncio.ensure_future(gate.pass_through(worker_idle=True))
        staying = asyncio.ensure_future(gate.pass_through(worker_idle=True))
        await asyncio.sleep(0.01)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await asyncio.sleep(0.01)
        assert not staying.done()  # still waiting for the request being prepared
    await asyncio.wait_for(staying, 1.0)  # released once nothing is being prepared


async def test_window_zero_disables_the_gate() -> None:
    gate = ArrivalGate(window_s=0.0)
    with gate.preparing():
        await asyncio.wait_for(gate.pass_through(worker_idle=True), 0.5)
    assert gate.held == 0


async def test_a_wave_through_the_real_gateway_is_held_together(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Six long-prompt requests at once to an idle worker: the ones tokenized
    first wait for the rest (the gate engages on the real request path, as
    /metrics counts), and every request is answered in full."""
    server = start_server(
        str(tiny_model_dir),
        tmp_path / "arrivals.log",
        model_name="tiny",
        env={"MLXD_ARRIVAL_WINDOW_S": "0.5"},
    )
    try:
        prompt = " ".join(f"word{i % 97}" for i in range(600))  # 2,900 tokens: a few ms to tokenize
        # Each its own first word: no prompt reuses another's tokens
        # (gateway/serving/prompt_tokens.py), so each takes those few ms.
        bodies = [greedy_chat_body(f"r{n} {prompt}", max_tokens=4) for n in range(6)]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for body in bodies)
            )
            metrics = (await client.get("/metrics")).text
        assert [r.status_code for r in responses] == [200] * 6
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)
        held = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("mlxd_arrival_window_held_total")
        ]
        # Each wave at the idle worker waits for its last one, which joins it.
        assert held and 2 <= held[0] <= 6
    finally:
        stop_server(server)
