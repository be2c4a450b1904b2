"""The gateway process's own resources as Prometheus gauges: tasks, file
descriptors, and the cyclic garbage collector's frozen objects and collections.

Leak checks read these (tests/test_reliability.py, tests/soak/): after any
workload, once every client has gone, the count of asyncio tasks and open file
descriptors must return to its resting value. `process_*` metrics (RSS, CPU,
fds) come from prometheus-client's ProcessCollector where the platform has
/proc. The gateway freezes its heap once a model's frontend is loaded
(gateway/workers/served_model.py): `mlxd_gateway_gc_frozen_objects` says it
did, `mlxd_gateway_gc_collections{generation}` how often the collector ran.

Threading: collected on the event loop, inside the /metrics handler.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def open_fds() -> int | None:
    """Open file descriptors of this process (None where it cannot be counted)."""
    for d in ("/proc/self/fd", "/dev/fd"):  # Linux, then macOS
        try:
            # listdir opens a descriptor of its own for the directory: not counted.
            return len(os.listdir(d)) - 1
        except OSError:
            continue
    return None


def asyncio_tasks() -> int | None:
    """Tasks of the running event loop, this one included (None off the loop)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return None


class GatewayCollector(Collector):
    """`mlxd_gateway_asyncio_tasks`, `mlxd_gateway_open_fds` and the collector's gauges."""

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in (
            ("mlxd_gateway_asyncio_tasks", "asyncio tasks of the gateway's loop", asyncio_tasks()),
            ("mlxd_gateway_open_fds", "open file descriptors of the gateway", open_fds()),
            (
                "mlxd_gateway_gc_frozen_objects",
                "objects frozen out of the cyclic collector's walks",
                gc.get_freeze_count(),
            ),
        ):
            g = GaugeMetricFamily(name, doc)
            if value is not None:
                g.add_metric([], float(value))
            yield g
        runs = GaugeMetricFamily(
            "mlxd_gateway_gc_collections",
            "the cyclic collector's runs since the gateway started, per generation",
            labels=["generation"],
        )
        for generation, stats in enumerate(gc.get_stats()):
            runs.add_metric([str(generation)], float(stats["collections"]))
        yield runs
