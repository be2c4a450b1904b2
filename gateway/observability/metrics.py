"""Prometheus metrics: GET /metrics, the per-request observations, the scrape refresh.

What is observed where (so the hot path stays cheap):
- per finished request (`observe_request`, called once by the request middleware):
  request counts by endpoint/status/finish reason, TTFT, end-to-end latency,
  queue wait, prompt and completion tokens, cancellations and
  cancellation-to-retirement latency;
- per delivered chunk (`TokenClock.tick`): the inter-token gap histogram, one
  observation per token after a request's first (a chunk of n coalesced tokens
  observes its gap split evenly n times), so its count is exactly completion
  tokens minus requests;
- per scrape (`refresh`, rendered by gateway/observability/scrape.py): everything
  that is state rather than an event, read when Prometheus asks: queue depth, in-flight, admission,
  worker state/restarts/heartbeat, model load and warm-up time, and the worker's
  own stats, fetched with one `stats` and one `step_timeline` utility call. The
  step timeline feeds the step-time and batch-size histograms, so every engine
  step is observed once without any per-step IPC. Numeric entries of the
  worker's `governor` stats become `mlxd_worker_memory_bytes{term=...}` and those
  of `prefix_cache` become `mlxd_prefix_cache_<key>`, whatever keys exist.

Every metric lives in the app's own `CollectorRegistry` (no process globals), so
tests can build several apps in one process.

Threading: event loop only (prometheus-client's own locks make the observations
thread-safe anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from gateway.observability.process_stats import GatewayCollector
from gateway.observability.scrape import ScrapeCollector
from gateway.observability.tracing import RequestRecord

if TYPE_CHECKING:
    from gateway.workers.registry import HostedModel, ModelRegistry

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CANCEL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

STATS_TIMEOUT_S = 2.0  # a scrape must not hang on a busy or wedged worker


class TokenClock:
    """Observes inter-token gaps of one request as its chunks are delivered."""

    __slots__ = ("_last", "_observe")

    def __init__(self, observe: Callable[[float], None]) -> None:
        self._observe = observe
        self._last: float | None = None

    def tick(self, n_tokens: int, now: float) -> None:
        if not n_tokens:
            return
        if self._last is None:
            # The first token's wait is TTFT; tokens delivered along with it
            # reached the client with no gap.
            gap, count = 0.0, n_tokens - 1
        else:
            gap, count = (now - self._last) / n_tokens, n_tokens
        for _ in range(count):
            self._observe(gap)
        self._last = now


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("model",)) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=r)

        labels = ("endpoint", "status", "finish_reason")
        self.requests = counter("mlxd_requests", "HTTP requests finished", labels)
        self.prompt_tokens = counter("mlxd_prompt_tokens", "Prompt tokens of requests")
        self.completion_tokens = counter("mlxd_completion_tokens", "Completion tokens delivered")
        self.ttft = histogram(
            "mlxd_time_to_first_token_seconds", "Arrival to the first generated token", TTFT_BUCKETS
        )
        self.token_gap = histogram(
            "mlxd_inter_token_gap_seconds",
            "Gap between delivered tokens of one request",
            GAP_BUCKETS,
        )
        self.e2e = histogram(
            "mlxd_request_duration_seconds",
            "Arrival to the end of the response (end to end)",
            E2E_BUCKETS,
        )
        self.queue_wait = histogram(
            "mlxd_queue_wait_seconds",
            "Arrival to submission to the worker (tokenize + queue)",
            QUEUE_BUCKETS,
        )
        self.cancellations = counter(
            "mlxd_cancellations", "Requests whose client went away, by stage", ("model", "stage")
        )
        self.cancel_latency = histogram(
            "mlxd_cancel_to_retire_seconds", "Client gone to request retired", CANCEL_BUCKETS
        )
        self.rejections = counter(
            "mlxd_admission_rejections",
            "Requests refused by admission (queue_full) or a rate limit (rate_limited)",
            ("model", "reason"),
        )
        self.step_time = histogram("mlxd_worker_step_seconds", "Engine step time", STEP_BUCKETS)
        self.batch_size = histogram(
            "mlxd_worker_batch_size", "Decoding rows per engine step", BATCH_BUCKETS
        )
        self.collector = ScrapeCollector()
        r.register(self.collector)
        r.register(GatewayCollector())
        with contextlib.suppress(ValueError):  # duplicated names on exotic platforms
            ProcessCollector(registry=r)
        self._lock = asyncio.Lock()
        self._timelines: dict[str, tuple[int | None, float]] = {}  # model -> (epoch, since)
        # (model, epoch) -> its first engine step's seconds
        self.first_step_s: dict[tuple[str, int], float] = {}
        # Cancelled requests whose retirement the worker has yet to confirm:
        # request id -> (model, when the client went away). Bounded: a worker
        # that dies never confirms.
        self._pending_cancels: dict[str, tuple[str, float]] = {}
        # Aborted requests the worker confirmed before the gateway recorded them
        # (the handler unwinds after sending the Abort, and a fast step can beat
        # it): request id -> when. Without this such a cancellation would be
        # lost and the histogram would keep only the slow ones. Bounded.
        self._early_retires: dict[str, float] = {}
        self.worker_confirms_retirement = False

    def install_retire_hook(self, hooks: list[Callable[[str, str | None, float], None]]) -> None:
        """Measure cancellation-to-retirement up to the worker's confirmation: `hooks` is
        a supervisor's `retire_hooks` (called with (request_id, finish_reason, monotonic
        time) for every terminal output of the worker). Without it, the latency ends
        when the gateway retires the request (its Abort is sent)."""
        hooks.append(self._on_worker_retired)
        self.worker_confirms_retirement = True

    def _on_worker_retired(self, request_id: str, finish_reason: str | None, at: float) -> None:
        entry = self._pending_cancels.pop(request_id, None)
        if entry is not None:
            model, cancelled_at = entry
            self.cancel_latency.labels(model).observe(max(0.0, at - cancelled_at))
        elif finish_reason == "abort":
            _bounded_put(self._early_retires, request_id, at)

    # -- per request ------------------------------------------------------------

    def token_clock(self, model: str) -> TokenClock:
        return TokenClock(self.token_gap.labels(model).observe)

    def observe_request(self, rec: RequestRecord) -> None:
        self.requests.labels(rec.endpoint, str(rec.status), rec.finish_reason or "").inc()
        if rec.rejected:
            self.rejections.labels(rec.model or "", rec.rejected).inc()
        m = rec.model
        if m is None or not rec.stages:
            return  # not a completion request that got past parsing
        if rec.cancelled:
            self.cancellations.labels(m, rec.cancel_stage).inc()
            cancelled_at = rec.stages.get("cancelled")
            if self.worker_confirms_retirement and rec.generation and cancelled_at is not None:
                # The worker confirms after its next step; the hook observes then,
                # unless it already has.
                at = self._early_retires.pop(rec.request_id, None)
                if at is not None:
                    self.cancel_latency.labels(m).observe(max(0.0, at - cancelled_at))
                else:
                    _bounded_put(self._pending_cancels, rec.request_id, (m, cancelled_at))
            elif (c := rec.cancel_to_retire_s) is not None:
                self.cancel_latency.labels(m).observe(c)
        if not rec.generation:
            return  # refused or failed before it reached the worker
        if rec.prompt_tokens:
            self.prompt_tokens.labels(m).inc(rec.prompt_tokens)
        if rec.completion_tokens:
            self.completion_tokens.labels(m).inc(rec.completion_tokens)
        if (q := rec.queue_time_s) is not None:
            self.queue_wait.labels(m).observe(q)
        if (t := rec.ttft_s) is not None:
            self.ttft.labels(m).observe(t)
        self.e2e.labels(m).observe(rec.latency_s)

    # -- per scrape ----------------------------------------------------------------

    async def refresh(
        self,
        registry: ModelRegistry,
        ready: Callable[[HostedModel], bool],
        startup_s: float | None,
    ) -> None:
        """Fetch every running worker's stats and new step timings for the next render."""
        async with self._lock:
            snaps = []
            for hosted in registry.hosted_models:
                served = hosted.served
                client = served.supervisor.client if served is not None else None
                snap: dict[str, Any] = {
                    "model": hosted.name,
                    "hosted": hosted,
                    "admission": hosted.admission,
                    "ready": ready(hosted),
                    "startup_s": startup_s,
                    "stats": None,
                    "first_step_s": None,
                }
                if client is not None and not client.closed:
                    with contextlib.suppress(Exception):  # down or busy: scrape what we know
                        snap["stats"] = await client.call("stats", timeout_s=STATS_TIMEOUT_S)
                        await self._observe_steps(client, hosted.name)
                if client is not None:
                    snap["first_step_s"] = self.first_step_s.get((hosted.name, client.epoch))
                snaps.append(snap)
            self.collector.snapshots = snaps

    async def _observe_steps(self, client: Any, model: str) -> None:
        epoch, since = self._timelines.get(model, (None, 0.0))
        if client.epoch != epoch:
            since = 0.0
        res = await client.call("step_timeline", {"since": since}, timeout_s=STATS_TIMEOUT_S)
        steps = res.get("steps") or []
        key = (model, client.epoch)
        if since == 0.0 and 0 < len(steps) < 8192 and key not in self.first_step_s:
            # The worker keeps its last 8192 steps; this is the first one when it
            # has run fewer. The first step pays MLX's first-run compilation.
            self.first_step_s[key] = float(steps[0][1])
        step_time, batch = self.step_time.labels(model), self.batch_size.labels(model)
        latest = since
        for t, seconds, decoding, _prompt in steps:
            if t <= since:
                continue  # `since` is inclusive on the worker's side
            step_time.observe(seconds)
            batch.observe(decoding)
            latest = max(latest, t)
        self._timelines[model] = (client.epoch, latest)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def metrics_handler(request: web.Request) -> web.Response:
    from gateway.http.app_keys import METRICS, MODELS
    from gateway.http.operations import model_readiness, startup_seconds

    metrics = request.app[METRICS]
    await metrics.refresh(
        request.app[MODELS],
        lambda hosted: model_readiness(request.app, hosted)[0],
        startup_seconds(request.app),
    )
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


def _bounded_put(d: dict[str, Any], key: str, value: Any, limit: int = 10_000) -> None:
    """Insert, dropping the oldest entry past `limit` (a dead worker never confirms)."""
    if len(d) >= limit:
        d.pop(next(iter(d)))
    d[key] = value
