"""The scrape-time collector: state gauges rendered from `Metrics.refresh`'s snapshots.

Everything that is state rather than an event is read when Prometheus asks (see
gateway/observability/metrics.py): queue depth, in-flight, admission, worker
state/restarts/heartbeat, model load and warm-up time, and the worker's own
stats. Numeric entries of the worker's `governor` stats become
`mlxd_worker_memory_bytes{term=...}` and those of `prefix_cache` become
`mlxd_prefix_cache_<key>`, whatever keys exist.

Threading: `collect` runs in the thread that renders the registry (the event loop).
"""

from __future__ import annotations

import importlib.metadata
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.frames import PROTOCOL_VERSION

if TYPE_CHECKING:
    from gateway.serving.admission import Admission
    from gateway.workers.registry import HostedModel


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


_NOT_BYTES = ("per_", "request", "deferral", "count", "ratio", "fraction", "tokens")


def _is_byte_term(key: str) -> bool:
    """Whether a governor stats key is a memory term in bytes (not a count or ratio)."""
    k = key.lower()
    return not k.endswith("_s") and not any(h in k for h in _NOT_BYTES)


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
        hosted: HostedModel = snap["hosted"]

        def gauge(name: str, doc: str, value: float | None, **labels: str) -> None:
            g = f.gauge(name, doc, ["model", *labels])
            if value is not None:
                g.add_metric([model, *labels.values()], value)

        gauge("mlxd_ready", "1 when the model is ready to serve", float(snap["ready"]))
        gauge(
            "mlxd_startup_seconds", "Gateway start to the pinned models serving", snap["startup_s"]
        )
        gauge("mlxd_model_running", "1 while the model has a worker", float(hosted.running))
        gauge("mlxd_model_leases", "Requests holding the model (blocking its stop)", hosted.leases)
        gauge("mlxd_model_starts", "Worker starts by the registry (lazy loads)", hosted.starts)
        gauge(
            "mlxd_model_footprint_bytes",
            "Memory charged to the model while it runs",
            hosted.footprint,
        )
        gauge("mlxd_queue_depth", "Requests accepted, waiting for an in-flight slot", adm.queued)
        gauge("mlxd_in_flight", "Requests holding an in-flight slot", adm.in_flight)
        gauge("mlxd_max_in_flight", "In-flight cap", adm.max_in_flight)
        gauge("mlxd_max_queued", "Queue cap", adm.max_queued)
        gauge("mlxd_drain_rate", "Slots freed per second over the drain window", adm.drain.rate())
        gauge("mlxd_admission_open", "1 when a new request would be admitted", float(adm.open))
        served = hosted.served
        if served is None:
            return
        sup = served.supervisor
        state = f.gauge("mlxd_worker_state", "1 for the worker's current state", ["model", "state"])
        for member in type(sup.state):
            state.add_metric([model, str(member.value)], float(member == sup.state))
        f.counter("mlxd_worker_restarts", "Worker restarts", ["model"]).add_metric(
            [model], float(sup.restarts)
        )
        gauge("mlxd_worker_epoch", "The current worker's epoch", float(sup.epoch))
        f.counter(
            "mlxd_arrival_window_held",
            "Requests that waited in the arrival window for the rest of their wave",
            ["model"],
        ).add_metric([model], float(served.arrivals.held))

        client = sup.client
        ready = client.ready if client is not None else None
        gauge(
            "mlxd_model_load_seconds",
            "Model load time in the worker",
            None if ready is None else ready.load_time_s,
        )
        stats = snap["stats"]
        warmup = (stats or {}).get("warmup_s")
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
            "out_of_memory_steps": (
                "mlxd_worker_out_of_memory_steps",
                "Engine steps that ran out of device memory (their requests requeued)",
            ),
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
