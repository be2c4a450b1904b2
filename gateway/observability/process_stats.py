"""The gateway process's own resources as Prometheus gauges: tasks, file descriptors.

Leak checks read these (tests/test_reliability.py, tests/soak/): after any
workload, once every client has gone, the count of asyncio tasks and open file
descriptors must return to its resting value. `process_*` metrics (RSS, CPU,
fds) come from prometheus-client's ProcessCollector where the platform has
/proc.

Threading: collected on the event loop, inside the /metrics handler.
"""

from __future__ import annotations

import asyncio
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
    """`mlxd_gateway_asyncio_tasks` and `mlxd_gateway_open_fds`."""

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in (
            ("mlxd_gateway_asyncio_tasks", "asyncio tasks of the gateway's loop", asyncio_tasks()),
            ("mlxd_gateway_open_fds", "open file descriptors of the gateway", open_fds()),
        ):
            g = GaugeMetricFamily(name, doc)
            if value is not None:
                g.add_metric([], float(value))
            yield g
