"""Prometheus metrics: GET /metrics, the per-request observations, the scrape collector.

What is observed where (so the hot path stays cheap):
- per finished request (`observe_request`, called once by the request middleware):
  request counts by endpoint/status/finish reason, TTFT, end-to-end latency,
  queue wait, prompt and completion tokens, cancellations and
  cancellation-to-retirement latency;
- per delivered chunk (`TokenClock.tick`): the inter-token gap histogram, one
  observation per token after a request's first (a chunk of n coalesced tokens
  observes its gap split evenly n times), so its count is exactly completion
  tokens minus requests;
- per scrape (`refresh` + `ScrapeCollector`): everything that is state rather
  than an event, read when Prometheus asks: queue depth, in-flight, admission,
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
import importlib.metadata
import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from gateway.observability.process_stats import GatewayCollector
from gateway.observability.tracing import RequestRecord
from protocol.frames import PROTOCOL_VERSION

if TYPE_CHECKING:
    from gateway.serving.admission import Admission
    from gateway.workers.registry import ModelRegistry, ModelSlot

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CANCEL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

STATS_TIMEOUT_S = 2.0  # a scrape must not hang on a busy or wedged worker


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _metric_name(key: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower()
    return name.removesuffix("_total") or "value"


def _numbers(d: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Numeric leaves of a stats dict, nested keys joined with '_'."""
    if not isinstance(d, dict):
        return
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, (int, float)):  # bool included: 0/1
            yield key, float(v)
        elif isinstance(v, dict):
            yield from _numbers(v, key + "_")


_NOT_BYTES = ("per_", "request", "deferral", "count", "ratio", "fraction")


def _is_byte_term(key: str) -> bool:
    """Whether a governor stats key is a memory term in bytes (not a count or ratio)."""
    k = key.lower()
    return not k.endswith("_s") and not any(h in k for h in _NOT_BYTES)


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
        self.requests = Counter(
            "mlxd_requests",
            "HTTP requests finished",
            ["endpoint", "status", "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "mlxd_prompt_tokens", "Prompt tokens of requests", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            "mlxd_completion_tokens", "Completion tokens delivered", ["model"], registry=r
        )
        self.ttft = Histogram(
            "mlxd_time_to_first_token_seconds",
            "Arrival to the first generated token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.token_gap = Histogram(
            "mlxd_inter_token_gap_seconds",
            "Gap between delivered tokens of one request",
            ["model"],
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "mlxd_request_duration_seconds",
            "Arrival to the end of the response (end to end)",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "mlxd_queue_wait_seconds",
            "Arrival to submission to the worker (tokenize + queue)",
            ["model"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.cancellations = Counter(
            "mlxd_cancellations",
            "Requests whose client went away, by stage",
            ["model", "stage"],
            registry=r,
        )
        self.cancel_latency = Histogram(
            "mlxd_cancel_to_retire_seconds",
            "Client gone to request retired",
            ["model"],
            buckets=CANCEL_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            "mlxd_admission_rejections",
            "Requests refused by admission (queue_full) or a rate limit (rate_limited)",
            ["model", "reason"],
            registry=r,
        )
        self.step_time = Histogram(
            "mlxd_worker_step_seconds",
            "Engine step time",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "mlxd_worker_batch_size",
            "Decoding rows per engine step",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
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
        self.worker_confirms_retirement = False

    def install_retire_hook(self, supervisor: Any) -> None:
        """Measure cancellation-to-retirement up to the worker's confirmation when the
        supervisor offers `retire_hooks` (callables of (request_id, finish_reason,
        monotonic time), called for every terminal output of the worker); else the
        latency ends when the gateway retires the request (its Abort is sent)."""
        hooks = getattr(supervisor, "retire_hooks", None)
        if isinstance(hooks, list):
            hooks.append(self._on_worker_retired)
            self.worker_confirms_retirement = True

    def _on_worker_retired(self, request_id: str, finish_reason: str | None, at: float) -> None:
        entry = self._pending_cancels.pop(request_id, None)
        if entry is not None:
            model, cancelled_at = entry
            self.cancel_latency.labels(model).observe(max(0.0, at - cancelled_at))

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
                # The worker confirms after its next step; the hook observes then.
                if len(self._pending_cancels) >= 10_000:
                    self._pending_cancels.pop(next(iter(self._pending_cancels)))
                self._pending_cancels[rec.request_id] = (m, cancelled_at)
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
        ready: Callable[[ModelSlot], bool],
        startup_s: float | None,
    ) -> None:
        """Fetch every running worker's stats and new step timings for the next render."""
        async with self._lock:
            snaps = []
            for slot in registry.slots:
                served = slot.served
                client = served.supervisor.client if served is not None else None
                snap: dict[str, Any] = {
                    "model": slot.name,
                    "slot": slot,
                    "admission": slot.admission,
                    "ready": ready(slot),
                    "startup_s": startup_s,
                    "stats": None,
                    "first_step_s": None,
                }
                if client is not None and not client.closed:
                    with contextlib.suppress(Exception):  # down or busy: scrape what we know
                        snap["stats"] = await client.call("stats", timeout_s=STATS_TIMEOUT_S)
                        await self._observe_steps(client, slot.name)
                if client is not None:
                    snap["first_step_s"] = self.first_step_s.get((slot.name, client.epoch))
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


_F = TypeVar("_F", GaugeMetricFamily, CounterMetricFamily)


class _Families:
    """Metric families by name: several models add samples to one family each."""

    def __init__(self) -> None:
        self.by_name: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
        return self._family(GaugeMetricFamily, name, doc, labels)

    def counter(self, name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
        return self._family(CounterMetricFamily, name, doc, labels)

    def _family(self, kind: type[_F], name: str, doc: str, labels: list[str]) -> _F:
        fam = self.by_name.get(name)
        if fam is None:
            fam = self.by_name[name] = kind(name, doc, labels=labels)
        assert isinstance(fam, kind)
        return fam


class ScrapeCollector(Collector):
    """State gauges rendered from the snapshots `Metrics.refresh` took (one per model)."""

    def __init__(self) -> None:
        self.snapshots: list[dict[str, Any]] = []

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("mlxd_build_info", "mlxd build", labels=["version", "protocol"])
        info.add_metric([_version("mlxd"), str(PROTOCOL_VERSION)], 1)
        yield info
        f = _Families()
        for snap in self.snapshots:
            self._model(f, snap)
        yield from f.by_name.values()

    def _model(self, f: _Families, snap: dict[str, Any]) -> None:
        model = snap["model"]
        adm: Admission = snap["admission"]
        slot: ModelSlot = snap["slot"]

        def gauge(name: str, doc: str, value: float | None, **labels: str) -> None:
            g = f.gauge(name, doc, ["model", *labels])
            if value is not None:
                g.add_metric([model, *labels.values()], value)

        gauge("mlxd_ready", "1 when the model is ready to serve", float(snap["ready"]))
        gauge(
            "mlxd_startup_seconds", "Gateway start to the pinned models serving", snap["startup_s"]
        )
        gauge("mlxd_model_running", "1 while the model has a worker", float(slot.running))
        gauge("mlxd_model_leases", "Requests holding the model (blocking its stop)", slot.leases)
        gauge("mlxd_model_starts", "Worker starts by the registry (lazy loads)", slot.starts)
        gauge(
            "mlxd_model_footprint_bytes",
            "Memory charged to the model while it runs",
            slot.footprint,
        )
        gauge("mlxd_queue_depth", "Requests accepted, waiting for an in-flight slot", adm.queued)
        gauge("mlxd_in_flight", "Requests holding an in-flight slot", adm.in_flight)
        gauge("mlxd_max_in_flight", "In-flight cap", adm.max_in_flight)
        gauge("mlxd_max_queued", "Queue cap", adm.max_queued)
        gauge("mlxd_drain_rate", "Slots freed per second over the drain window", adm.drain.rate())
        gauge("mlxd_admission_open", "1 when a new request would be admitted", float(adm.open))
        served = slot.served
        if served is None:
            return
        sup = served.supervisor
        state = f.gauge("mlxd_worker_state", "1 for the worker's current state", ["model", "state"])
        for member in type(sup.state):
            state.add_metric([model, str(member.value)], float(member == sup.state))
        restarts = getattr(sup, "restarts", None)
        if restarts is None:
            restarts = max(0, sup.epoch - 1)  # each (re)start takes a new epoch
        f.counter("mlxd_worker_restarts", "Worker restarts", ["model"]).add_metric(
            [model], float(restarts)
        )
        gauge("mlxd_worker_epoch", "The current worker's epoch", float(sup.epoch))

        client = sup.client
        ready = client.ready if client is not None else None
        gauge(
            "mlxd_model_load_seconds",
            "Model load time in the worker",
            None if ready is None else ready.load_time_s,
        )
        stats = snap["stats"]
        warmup = (stats or {}).get("warmup_s")
        if warmup is None and ready is not None:
            warmup = getattr(ready, "warmup_s", None)
        if warmup is None:
            warmup = snap["first_step_s"]
        gauge(
            "mlxd_model_warmup_seconds",
            "First-run warm-up (the worker's warm-up, else its first engine step)",
            warmup,
        )
        if client is not None and not client.closed:
            now = time.monotonic()
            gauge(
                "mlxd_worker_heartbeat_age_seconds",
                "Since the last heartbeat",
                now - client.last_heartbeat_at,
            )
            gauge(
                "mlxd_worker_step_progress_age_seconds",
                "Since the engine's step counter last moved",
                now - client.last_step_progress_at,
            )
        gauge(
            "mlxd_worker_stats_up",
            "1 when the last scrape got the worker's stats",
            float(stats is not None),
        )
        if stats is not None:
            self._worker(f, model, stats)

    def _worker(self, f: _Families, model: str, stats: dict[str, Any]) -> None:
        counters = {
            "steps": ("mlxd_worker_steps", "Engine steps of the current worker"),
            "prompt_tokens": ("mlxd_worker_prompt_tokens", "Prompt tokens prefilled"),
            "generated_tokens": ("mlxd_worker_generated_tokens", "Tokens generated"),
        }
        for key, (name, doc) in counters.items():
            if isinstance(stats.get(key), (int, float)):
                f.counter(name, doc, ["model"]).add_metric([model], float(stats[key]))
        outcomes = f.counter(
            "mlxd_worker_requests", "Requests seen by the worker", ["model", "outcome"]
        )
        for outcome in ("added", "finished", "aborted", "rejected"):
            v = stats.get(f"requests_{outcome}")
            if isinstance(v, (int, float)):
                outcomes.add_metric([model, outcome], float(v))
        gauges = {
            "batch_rows": ("mlxd_worker_batch_rows", "Rows in the running batch"),
            "decoding": ("mlxd_worker_decoding", "Rows decoding"),
            "queued": ("mlxd_worker_queued", "Requests waiting inside the worker"),
            "decode_step_s": ("mlxd_worker_decode_step_seconds", "Decode step time (EMA)"),
            "prefill_s_per_token": (
                "mlxd_worker_prefill_seconds_per_token",
                "Prefill time per token (EMA)",
            ),
            "prefill_chunk": ("mlxd_worker_prefill_chunk", "Current prefill chunk size"),
        }
        for key, (name, doc) in gauges.items():
            v = stats.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                f.gauge(name, doc, ["model"]).add_metric([model], float(v))
        mem = f.gauge(
            "mlxd_worker_memory_bytes", "Memory governor terms (bytes)", ["model", "term"]
        )
        for term, v in _numbers(stats.get("governor")):
            if _is_byte_term(term):
                mem.add_metric([model, term], v)
            else:  # counts and ratios the governor reports beside its terms
                name = "mlxd_governor_" + _metric_name(term)
                f.gauge(name, f"Memory governor: {term}", ["model"]).add_metric([model], v)
        mlx = f.gauge("mlxd_worker_mlx_memory_bytes", "MLX allocator memory", ["model", "kind"])
        for kind, v in _numbers(stats.get("memory")):
            mlx.add_metric([model, kind], v)
        seen: set[str] = set()
        for key, v in _numbers(stats.get("prefix_cache")):
            name = "mlxd_prefix_cache_" + _metric_name(key)
            if name in seen:
                continue
            seen.add(name)
            f.gauge(name, f"Prefix cache: {key}", ["model"]).add_metric([model], v)


async def metrics_handler(request: web.Request) -> web.Response:
    from gateway.http.app_keys import METRICS, MODELS
    from gateway.http.operations import slot_readiness, startup_seconds

    metrics = request.app[METRICS]
    await metrics.refresh(
        request.app[MODELS],
        lambda slot: slot_readiness(request.app, slot)[0],
        startup_seconds(request.app),
    )
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
