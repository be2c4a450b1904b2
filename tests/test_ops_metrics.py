"""/metrics, request logs and request ids on the shared server: exact counts for a known workload.

The tiny random model never emits EOS, so every request runs to max_tokens
(finish_reason "length") and the expected token counts are exact.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Server, leave_after_events, start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """This module's own server: its tests assert exact counter deltas, which a
    request still finishing from another module (a cut-off slow reader, an
    abandoned stream) would otherwise land in."""
    log = tmp_path_factory.mktemp("logs") / "metrics.log"
    srv = start_server(str(tiny_model_dir), log, model_name="tiny")
    yield srv
    stop_server(srv)


LOG_FIELDS = {
    "client_request_id",
    "request_id",
    "model",
    "prompt_tokens",
    "max_tokens",
    "stream",
    "queue_time_ms",
    "ttft_ms",
    "latency_ms",
    "completion_tokens",
    "finish_reason",
    "cancelled",
    "error",
}


class Scrape:
    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels`."""
        return sum(
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )


def scrape(server: Server) -> Scrape:
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return Scrape(r.text)


def request_log(server: Server) -> Iterator[dict]:
    for line in server.log().splitlines():
        if line.startswith("{") and '"event": "request"' in line:
            yield json.loads(line)


def test_counters_move_by_the_exact_workload(server: Server) -> None:
    server.wait_idle()
    before = scrape(server)
    prompt_tokens = 0
    completion = 0
    ids = []
    for i in range(3):  # non-streaming chat
        rid = f"wl-chat-{i}-{time.monotonic_ns()}"
        r = httpx.post(
            f"{server.v1}/chat/completions",
            headers={"X-Request-ID": rid},
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": f"n{i}"}],
                "max_tokens": 5,
                "temperature": 0,
                # random weights may pick EOS; the counts below expect "length"
                "logit_bias": {"0": -100, "1": -100, "2": -100},
            },
            timeout=60,
        )
        assert r.status_code == 200
        assert r.headers["X-Request-ID"] == rid
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
        completion += r.json()["usage"]["completion_tokens"]
        ids.append((rid, False, 5))
    for i in range(2):  # streaming completions with usage
        rid = f"wl-stream-{i}-{time.monotonic_ns()}"
        with httpx.stream(
            "POST",
            f"{server.v1}/completions",
            headers={"X-Request-ID": rid},
            json={
                "model": "tiny",
                "prompt": f"stream {i}",
                "max_tokens": 7,
                "temperature": 0,
                "logit_bias": {"0": -100, "1": -100, "2": -100},
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=60,
        ) as r:
            assert r.headers["X-Request-ID"] == rid  # echoed on streams too
            usage = [
                json.loads(x[6:])["usage"]
                for x in r.iter_lines()
                if x.startswith("data: {") and '"usage"' in x
            ][-1]
        prompt_tokens += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
        ids.append((rid, True, 7))
    bad = httpx.post(
        f"{server.v1}/chat/completions",
        json={"model": "tiny", "messages": [], "max_tokens": 2},
        timeout=30,
    )
    assert bad.status_code == 400
    assert completion == 3 * 5 + 2 * 7
    server.wait_idle()
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    chat_ep, cmpl_ep = "/v1/chat/completions", "/v1/completions"
    assert delta("mlxd_requests_total", endpoint=chat_ep, status="200", finish_reason="length") == 3
    assert delta("mlxd_requests_total", endpoint=cmpl_ep, status="200", finish_reason="length") == 2
    assert delta("mlxd_requests_total", endpoint=chat_ep, status="400") == 1
    assert delta("mlxd_prompt_tokens_total", model="tiny") == prompt_tokens
    assert delta("mlxd_completion_tokens_total", model="tiny") == completion
    for hist in (
        "mlxd_time_to_first_token_seconds",
        "mlxd_request_duration_seconds",
        "mlxd_queue_wait_seconds",
    ):
        assert delta(hist + "_count", model="tiny") == 5, hist
        assert delta(hist + "_sum", model="tiny") > 0, hist
    # One gap per token after each request's first.
    assert delta("mlxd_inter_token_gap_seconds_count", model="tiny") == completion - 5
    # The worker's own counters agree with what the gateway delivered...
    assert delta("mlxd_worker_generated_tokens_total", model="tiny") == completion
    assert delta("mlxd_worker_requests_total", model="tiny", outcome="finished") == 5
    # ...and every engine step is observed exactly once in the step histograms.
    steps = delta("mlxd_worker_steps_total", model="tiny")
    assert steps >= 7
    assert delta("mlxd_worker_step_seconds_count", model="tiny") == steps
    assert delta("mlxd_worker_batch_size_count", model="tiny") == steps
    assert delta("mlxd_cancellations_total", model="tiny") == 0

    # State gauges.
    assert after.get("mlxd_queue_depth", model="tiny") == 0
    assert after.get("mlxd_in_flight", model="tiny") == 0
    assert after.get("mlxd_ready", model="tiny") == 1
    assert after.get("mlxd_worker_state", model="tiny", state="ready") == 1
    assert after.get("mlxd_model_load_seconds", model="tiny") > 0
    assert after.get("mlxd_model_warmup_seconds", model="tiny") > 0
    assert after.get("mlxd_worker_stats_up", model="tiny") == 1
    assert "mlxd_worker_restarts_total" in after.text
    for family in ("mlxd_worker_memory_bytes", "mlxd_build_info"):
        assert family in after.text

    # One log line per request, with every field, matching the responses.
    lines = {x["client_request_id"]: x for x in request_log(server)}
    for rid, stream, max_tokens in ids:
        line = lines[rid]
        assert set(line) >= LOG_FIELDS, LOG_FIELDS - set(line)
        assert line["model"] == "tiny" and line["stream"] is stream
        assert line["max_tokens"] == max_tokens and line["completion_tokens"] == max_tokens
        assert line["finish_reason"] == "length" and line["cancelled"] is False
        assert line["error"] is None and line["status"] == 200
        assert line["prompt_tokens"] > 0
        assert 0 <= line["queue_time_ms"] <= line["ttft_ms"] <= line["latency_ms"]
    assert sum(1 for x in request_log(server) if x["client_request_id"] == ids[0][0]) == 1


def test_scrape_parses_and_every_worker_stat_is_rendered(server: Server) -> None:
    s = scrape(server)
    names = {fam.name for fam in text_string_to_metric_families(s.text)}
    stats = server.worker_stats()
    for key, value in (stats.get("governor") or {}).items():
        if isinstance(value, (int, float)):
            assert f'term="{key}"' in s.text or f"mlxd_governor_{key}" in names, key
    # a count of tokens, not a memory term in bytes
    assert "mlxd_governor_scratch_reserve_tokens" in names
    assert 'term="scratch_reserve_tokens"' not in s.text
    for key, value in (stats.get("prefix_cache") or {}).items():
        if isinstance(value, (int, float)):
            name = "mlxd_prefix_cache_" + re.sub(r"[^a-z0-9_]", "_", key.lower())
            assert name.removesuffix("_total") in names, key


def test_both_processes_freeze_their_heap_once_serving(server: Server) -> None:
    """The imports, the app, the tokenizer and the model's modules sit out of the
    cyclic collector's walks once the model serves (0 frozen before)."""
    s = scrape(server)
    assert s.get("mlxd_gateway_gc_frozen_objects") > 10_000
    assert s.get("mlxd_gateway_gc_collections", generation="2") >= 1  # the freeze's own
    heap = server.worker_stats()["python_heap"]
    assert heap["frozen"] > 10_000
    assert len(heap["collections"]) == 3 and heap["collections"][2] >= 1


def test_cancellation_is_counted_and_logged(server: Server) -> None:
    server.wait_idle()
    before = scrape(server)
    rid = f"cancel-me-{time.monotonic_ns()}"
    assert leave_after_events(server, "go", headers={"X-Request-ID": rid}) == 3
    server.wait_idle()
    after = scrape(server)
    assert (
        after.get("mlxd_cancellations_total", model="tiny", stage="decode")
        - before.get("mlxd_cancellations_total", model="tiny", stage="decode")
        == 1
    )
    assert (
        after.get("mlxd_cancel_to_retire_seconds_count", model="tiny")
        - before.get("mlxd_cancel_to_retire_seconds_count", model="tiny")
        == 1
    )
    line = next(x for x in request_log(server) if x["client_request_id"] == rid)
    assert line["cancelled"] is True and line["status"] == 499
    assert line["completion_tokens"] < 2000


def test_request_id_generated_when_absent_or_invalid(server: Server) -> None:
    r = httpx.get(server.v1 + "/models")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-ID"])
    r = httpx.get(server.v1 + "/models", headers={"X-Request-ID": "x" * 200})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-ID"])
    r = httpx.get(server.url + "/nope", headers={"X-Request-ID": "err-42"})
    assert r.status_code == 404 and r.headers["X-Request-ID"] == "err-42"


def test_version_and_model_status(server: Server) -> None:
    v = httpx.get(server.url + "/version").json()
    assert v["protocol_version"] >= 1 and v["version"] and v["model_identity"]
    models = httpx.get(server.url + "/models").json()["data"]
    assert [(m["id"], m["state"], m["ready"]) for m in models] == [("tiny", "ready", True)]
    st = server.status()
    for key in (
        "state",
        "phase",
        "ready",
        "identity",
        "load_time_s",
        "queue",
        "memory",
        "worker",
        "restarts",
        "context_length",
        "startup_s",
    ):
        assert key in st, key
    assert st["state"] == "ready" and st["load_time_s"] > 0
    assert st["queue"]["max_in_flight"] >= 1
    assert httpx.get(server.url + "/models/nope/status").status_code == 404
    assert httpx.get(server.url + "/models/tiny/ready").status_code == 200
    assert httpx.get(server.url + "/models/nope/ready").status_code == 404


@pytest.mark.parametrize("path", ["/live", "/startup", "/ready", "/health"])
def test_probes_are_200_when_serving(server: Server, path: str) -> None:
    r = httpx.get(server.url + path)
    assert r.status_code == 200, r.text


# -- in-process units ------------------------------------------------------------------


def _record(**kw: object):  # type: ignore[no-untyped-def]
    from gateway.observability.tracing import RequestRecord

    base: dict = dict(
        request_id="r1",
        method="POST",
        path="/v1/completions",
        endpoint="/v1/completions",
        status=499,
        start=10.0,
        end=12.0,
        stages={
            "arrival": 10.0,
            "submitted": 10.1,
            "first_token": 10.2,
            "cancelled": 11.0,
            "retired": 11.001,
        },
        model="tiny",
        cancelled=True,
        generation=True,
        completion_tokens=3,
    )
    base.update(kw)
    return RequestRecord(**base)


def _count(metrics, name: str) -> float:  # type: ignore[no-untyped-def]
    return Scrape(metrics.render().decode()).get(name, model="tiny")


def test_cancel_latency_waits_for_the_workers_confirmation() -> None:
    from gateway.observability.metrics import Metrics

    plain = Metrics()
    plain.observe_request(_record())
    assert _count(plain, "mlxd_cancel_to_retire_seconds_count") == 1
    assert _count(plain, "mlxd_cancel_to_retire_seconds_sum") == pytest.approx(0.001)

    hooks: list = []  # a supervisor's retire_hooks
    hooked = Metrics()
    hooked.install_retire_hook(hooks)
    hooked.observe_request(_record())
    assert _count(hooked, "mlxd_cancel_to_retire_seconds_count") == 0
    for hook in hooks:
        hook("other", "length", 11.5)
        hook("r1", "abort", 11.25)
        hook("r1", "abort", 11.5)  # only the first confirmation counts
    assert _count(hooked, "mlxd_cancel_to_retire_seconds_count") == 1
    assert _count(hooked, "mlxd_cancel_to_retire_seconds_sum") == pytest.approx(0.25)
    assert _count(hooked, "mlxd_cancellations_total") == 1


def test_token_clock_observes_one_gap_per_token_after_the_first() -> None:
    from gateway.observability.metrics import Metrics

    m = Metrics()
    clock = m.token_clock("tiny")
    clock.tick(3, 1.0)  # a coalesced first chunk: 2 gaps of 0
    clock.tick(0, 1.5)  # nothing
    clock.tick(1, 2.0)
    clock.tick(4, 4.0)  # 4 tokens over 2 s: 0.5 s each
    assert _count(m, "mlxd_inter_token_gap_seconds_count") == 2 + 1 + 4
    assert _count(m, "mlxd_inter_token_gap_seconds_sum") == pytest.approx(1.0 + 2.0)


def test_trace_file_is_valid_json_after_close(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gateway.observability.tracing import TraceWriter

    w = TraceWriter(tmp_path / "t" / "trace.json")
    w.open()
    w.write(_record(request_id="a", cancelled=False, stages={"arrival": 10.0, "retired": 11.0}))
    w.write(_record(request_id="b", generation=False))  # not a generation: skipped
    w.close()
    events = json.loads((tmp_path / "t" / "trace.json").read_text())
    ids = {(e.get("args") or {}).get("request_id") for e in events}
    assert "a" in ids and "b" not in ids


def _cancelled_record(request_id: str, cancelled_at: float) -> Any:
    from gateway.observability.tracing import RequestRecord

    return RequestRecord(
        request_id=request_id,
        method="POST",
        path="/v1/chat/completions",
        endpoint="/v1/chat/completions",
        status=499,
        start=cancelled_at - 1.0,
        end=cancelled_at + 0.001,
        stages={"arrival": cancelled_at - 1.0, "cancelled": cancelled_at},
        model="m",
        cancelled=True,
        generation=True,
    )


def test_cancel_latency_counts_a_worker_confirmation_that_beats_the_gateways_record() -> None:
    """The worker may confirm an abort before the handler has unwound and the
    request is recorded: that cancellation is still measured, once."""
    from gateway.observability.metrics import Metrics

    m = Metrics()
    hooks: list[Any] = []
    m.install_retire_hook(hooks)
    (hook,) = hooks
    hook("early", "abort", 10.004)  # confirmed first ...
    m.observe_request(_cancelled_record("early", 10.0))  # ... recorded after
    hook("late", "length", 11.0)  # someone else's terminal output: ignored
    m.observe_request(_cancelled_record("late", 20.0))  # recorded first ...
    hook("late", "abort", 20.007)  # ... confirmed after
    hook("early", "abort", 30.0)  # a repeat confirmation adds nothing
    samples = {s.name: s.value for metric in m.cancel_latency.collect() for s in metric.samples}
    assert samples["mlxd_cancel_to_retire_seconds_count"] == 2
    assert samples["mlxd_cancel_to_retire_seconds_sum"] == pytest.approx(0.011)
