"""A 2-rank worker group (mx.distributed, ring backend over loopback, CPU) behind the gateway."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import (
    NO_EOS,
    Server,
    decode_together,
    greedy_body,
    start_server,
    stop_server,
)


@pytest.fixture(scope="module")
def group_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "group.log"
    srv = start_server(
        str(tiny_model_dir),
        log,
        model_name="tiny",
        env={
            "MLXD_GROUP_SIZE": "2",
            "MLXD_RESTART_BACKOFF_INITIAL_S": "0.1",
            "MLXD_PREFILL_CHUNK": "256",
        },
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    model, tokenizer = load(str(tiny_model_dir))
    bias = make_logits_processors(logit_bias={int(k): float(v) for k, v in NO_EOS.items()})

    def generate(prompt_ids: list[int], n: int) -> list[int]:
        return [
            int(r.token)
            for r in stream_generate(
                model,
                tokenizer,
                prompt_ids,
                max_tokens=n,
                sampler=make_sampler(temp=0.0),
                logits_processors=bias,
            )
        ]

    return generate


def test_group_reports_both_ranks(group_server: Server) -> None:
    ranks = group_server.status()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["alive"] for r in ranks)
    assert ranks[0]["pid"] == group_server.status()["worker_pid"]


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 60))])
def test_greedy_output_equals_single_process(
    group_server: Server, reference, prompt: list[int]
) -> None:
    body = group_server.complete(prompt, 12)
    assert body["choices"][0]["token_ids"] == reference(prompt, 12)


def test_streaming_through_the_group(group_server: Server, reference) -> None:
    ids: list[int] = []
    with httpx.stream(
        "POST",
        group_server.v1 + "/completions",
        json=greedy_body("tiny", [7, 7, 7], 8, stream=True),
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    assert ids == reference([7, 7, 7], 8)


def test_concurrent_requests_batch(group_server: Server, reference) -> None:
    prompts = [[20 + i, 30, 40 + i] for i in range(4)]
    bodies = [
        {
            "model": "tiny",
            "prompt": p,
            "max_tokens": 3000,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "return_token_ids": True,
        }
        for p in prompts
    ]
    outs, stats = decode_together(group_server, "/completions", bodies, 16)
    assert outs == [reference(p, 16) for p in prompts]
    # the four decode as rows of one batch on both ranks, not one after another
    assert stats["decoding"] == 4, json.dumps(stats)
    group_server.wait_idle()


def test_abort_reaches_every_rank(group_server: Server) -> None:
    before = group_server.worker_stats()
    with httpx.stream(
        "POST",
        group_server.v1 + "/completions",
        json={
            "model": "tiny",
            "prompt": [1, 2, 3],
            "max_tokens": 3000,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "stream": True,
        },
        timeout=120,
    ) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n > 6:
                break
    # The abort is counted when the worker takes it and its row leaves the batch
    # at the group's next round, so poll until both have happened (bounded).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = group_server.worker_stats()
        if after["requests_aborted"] > before["requests_aborted"] and not after["batch_rows"]:
            break
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["requests"] == 0 and after["batch_rows"] == 0
    # the group still serves in lock-step afterwards
    assert len(group_server.complete([4, 5, 6], 4)["choices"][0]["token_ids"]) == 4


def test_killing_rank_1_restarts_the_group_and_replays(group_server: Server, reference) -> None:
    ranks = group_server.status()["ranks"]
    prompt = [9, 19, 29, 39]
    expected = reference(prompt, 200)
    started = threading.Event()
    result: dict = {}

    def run() -> None:
        started.set()
        result["body"] = group_server.complete(prompt, 200)

    t = threading.Thread(target=run)
    t.start()
    started.wait()
    # wait until the request is in the batch, then take rank 1 away
    for _ in range(400):
        if group_server.worker_stats()["requests"] == 1:
            break
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    t.join(180)
    assert result["body"]["choices"][0]["token_ids"] == expected
    new = group_server.status()
    assert new["restarts"] >= 1
    assert {r["pid"] for r in new["ranks"]}.isdisjoint({r["pid"] for r in ranks})
    assert all(r["alive"] for r in new["ranks"])


def test_allreduce_probe_times_a_steps_collectives_over_the_group_environment(
    tmp_path: Path,
) -> None:
    """bench.allreduce_probe (issue #16): two ranks with the supervisor's ring
    environment; every rank took part (the sums check), and a step's time is
    measured per row count."""
    from bench.allreduce_probe import main

    out = tmp_path / "probe.json"
    argv = ["--ranks=2", "--hidden=64", "--layers=2", "--rows=1,8", "--iters=3"]
    assert main([*argv, "--dtype=float32", f"--out={out}"]) == 0
    result = json.loads(out.read_text())
    assert result["size"] == 2 and result["rank"] == 0
    assert set(result["rows"]) == {"1", "8"}
    assert all(r["ok"] and r["step_s"] > 0 for r in result["rows"].values())
