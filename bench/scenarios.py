"""Replays the workload's scenarios against one server (mlxd or the peer).

Owns the choreography of each scenario kind (who sends what, when, and when a
client leaves) and what the server reports around it: mlxd's worker stats
(memory terms, prefix cache, aborted requests, decode step time) and its
Prometheus histogram of cancellation latency, plus process RSS for both
servers. Every scenario returns the same shape:

    {"kind", "wall_s", "waves": [{"wall_s", "requests": [RequestRecord JSON]}],
     "extra": {...kind-specific facts...}, "after": {...state once idle...}}

Request times in a scenario are relative to the scenario's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.client import RequestRecord, Target, get_json, get_text, make_session, send
from bench.heap import settle_heap
from bench.progress import Progress
from bench.servers import ServerProcess, cpu_seconds, rss_bytes
from bench.stats import percentile
from bench.workload import PAIRED_KINDS, RequestSpec, Scenario, Workload

SETTLE_TIMEOUT_S = 60.0
RETIRE_POLL_TIMEOUT_S = 5.0
SLOW_READER_RCVBUF = 4096
WORKER_STEP_HISTOGRAM = "mlxd_worker_step_seconds"
CANCEL_HISTOGRAM = "mlxd_cancel_to_retire_seconds"


@dataclass(frozen=True, slots=True)
class Started:
    """A scenario's start: its clock origin, mlxd's metrics and the processes' CPU then."""

    t0: float
    metrics: str | None
    cpu: dict[str, tuple[int | None, float | None]]  # role -> (pid, CPU seconds)


class TargetRunner:
    def __init__(
        self, target: Target, server: ServerProcess, workload: Workload, progress: Progress
    ) -> None:
        self.target = target
        self.server = server
        self.workload = workload
        self.progress = progress
        self.timeout_s = workload.preset.request_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.idle_long_ttft_s: float | None = None

    # -- the server's own view (mlxd only) -------------------------------------

    @property
    def has_stats(self) -> bool:
        return self.target.status_path is not None

    async def status(self) -> dict[str, Any] | None:
        if not self.has_stats:
            return None
        assert self.session is not None and self.target.status_path is not None
        try:
            body = await get_json(self.session, self.target.url + self.target.status_path)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    async def worker_stats(self) -> dict[str, Any] | None:
        st = await self.status()
        worker = (st or {}).get("worker")
        return worker if isinstance(worker, dict) else None

    async def snapshot(self) -> dict[str, Any]:
        """Memory at this moment: worker terms (mlxd) and process RSS (both)."""
        snap: dict[str, Any] = {"rss": {self.target.name: rss_bytes(self.server.pid)}}
        st = await self.status()
        if st is not None:
            w = st.get("worker") or {}
            snap["rss"]["worker"] = rss_bytes(st.get("worker_pid"))
            snap["governor"] = w.get("governor")
            snap["memory"] = w.get("memory")
            snap["prefix_cache"] = w.get("prefix_cache")
            snap["requests"] = w.get("requests")
            snap["active"] = w.get("active")
            snap["batch_rows"] = w.get("batch_rows")
            snap["decode_step_s"] = w.get("decode_step_s")
            snap["prefill_s_per_token"] = w.get("prefill_s_per_token")
            snap["prefill_chunk"] = w.get("prefill_chunk")
            snap["steps"] = w.get("steps")
            snap["backend"] = st.get("backend")
            snap["blas"] = st.get("blas")
            snap["identity"] = st.get("identity")
        return snap

    async def settle(self, after_cancel: bool = False) -> dict[str, Any]:
        """Wait until the server holds no request, then snapshot it."""
        if not self.has_stats:
            # mlx_lm.server has no stats: give cancelled generations time to stop.
            await asyncio.sleep(1.0 if after_cancel else 0.2)
            return await self.snapshot()
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            w = await self.worker_stats()
            if w is not None and not w.get("requests") and not w.get("batch_rows"):
                break
            await asyncio.sleep(0.05)
        return await self.snapshot()

    async def processes(self) -> dict[str, int | None]:
        """The target's server processes by role: mlxd's gateway and worker apart,
        any other target's one process."""
        if not self.has_stats:
            return {"server": self.server.pid}
        return {"gateway": self.server.pid, "worker": (await self.status() or {}).get("worker_pid")}

    async def metrics_text(self) -> str | None:
        if not self.has_stats:
            return None
        assert self.session is not None
        try:
            return await get_text(self.session, self.target.url + "/metrics")
        except (aiohttp.ClientError, TimeoutError):
            return None

    # -- the run -----------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Every scenario in order, alone on the machine (plain `bench run`)."""
        async with make_session() as session:
            before = await self.open(session)
            scenarios = {s.name: await self.scenario(s) for s in self.workload.scenarios}
            return await self.close(scenarios, before)

    async def open(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """The warm-up waves, then the server's resting state."""
        self.session = session
        for wave in self.workload.warmup:
            await self._gather(wave)
        settle_heap()
        return await self.settle()

    async def close(self, scenarios: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        after = await self.settle()
        self.session = None
        return {"scenarios": scenarios, "memory": {"before": before, "after": after}}

    async def scenario(self, s: Scenario) -> dict[str, Any]:
        started = await self.begin(s)
        if s.kind in PAIRED_KINDS:
            waves = [await self.wave(s, i, started.t0) for i in range(len(s.waves()))]
            result = self.paired(s, waves)
        else:
            result = await getattr(self, "_" + s.kind)(s, started.t0)
        return await self.end(s, started, result)

    async def begin(self, s: Scenario) -> Started:
        settle_heap()
        self.progress.begin(f"{self.target.name} {s.name}", len(s.requests()))
        # Each process's CPU so far, read after the status call that names them.
        cpu = {k: (pid, cpu_seconds(pid)) for k, pid in (await self.processes()).items()}
        return Started(time.monotonic(), await self.metrics_text(), cpu)

    async def end(self, s: Scenario, started: Started, result: dict[str, Any]) -> dict[str, Any]:
        """The scenario's result with the server's view around it, once it is idle again."""
        result["kind"] = s.kind
        # First: scraping the metrics and the settle below are not the scenario's work.
        # The same processes as at the start: a worker that was restarted meanwhile is gone.
        result["cpu_s"] = {
            k: round(after - before, 3)
            for k, (pid, before) in started.cpu.items()
            if before is not None and (after := cpu_seconds(pid)) is not None
        }
        metrics_after = await self.metrics_text()
        if started.metrics is not None and metrics_after is not None:
            # The worker's own step times (runner.step, from its step log):
            # against the client's gaps, what the serving path adds.
            result["worker_steps"] = histogram_delta(
                started.metrics, metrics_after, WORKER_STEP_HISTOGRAM
            )
        result["t0"] = started.t0  # the monotonic clock: request times are relative to it
        result["wall_s"] = time.monotonic() - started.t0
        result["after"] = await self.settle(after_cancel=s.kind == "cancel")
        errors = sum(1 for w in result["waves"] for r in w["requests"] if not r["ok"])
        self.progress.end(f"{errors} errors" if errors else "")
        return result

    async def wave(self, s: Scenario, index: int, t0: float) -> dict[str, Any]:
        """Wave `index` of a scenario every target runs (a kind in PAIRED_KINDS)."""
        settle_heap()
        return self._wave(await self._gather(s.waves()[index]), t0)

    def paired(self, s: Scenario, waves: list[dict[str, Any]]) -> dict[str, Any]:
        if s.kind == "long_prefill":
            ttfts = [
                r["first_token"] - r["sent"]
                for w in waves
                for r in w["requests"]
                if r["ok"] and r["first_token"] is not None
            ]
            self.idle_long_ttft_s = percentile(ttfts, 50)
        extra = {"concurrency": s.params["concurrency"]} if s.kind == "sweep" else {}
        return {"waves": waves, "extra": extra}

    async def _gather(self, specs: list[RequestSpec], **kw: Any) -> list[RequestRecord]:
        assert self.session is not None
        return list(await asyncio.gather(*(self._one(s, **kw) for s in specs)))

    async def _one(
        self, spec: RequestSpec, session: aiohttp.ClientSession | None = None, **kw: Any
    ) -> RequestRecord:
        sess = session or self.session
        assert sess is not None
        rec = await send(sess, self.target, spec, timeout_s=self.timeout_s, **kw)
        self.progress.tick()
        return rec

    @staticmethod
    def _wave(records: list[RequestRecord], t0: float) -> dict[str, Any]:
        if records:
            start = min(r.sent for r in records)
            end = max((r.done or r.sent) for r in records)
        else:
            start = end = t0
        return {"wall_s": end - start, "requests": [r.to_json(t0) for r in records]}

    # -- scenario kinds ------------------------------------------------------------

    async def _nonstream(self, s: Scenario, t0: float) -> dict[str, Any]:
        recs = [await self._one(r) for r in s.groups["requests"]]
        return {"waves": [self._wave(recs, t0)], "extra": {}}

    async def _shared_prefix(self, s: Scenario, t0: float) -> dict[str, Any]:
        before = await self.worker_stats()
        recs: list[RequestRecord] = []
        canned: dict[str, str] = s.params.get("replies") or {}
        for turns in s.groups.values():
            messages: list[dict[str, str]] = []
            for turn in turns:
                messages = [*messages, *turn.messages]
                rec = await self._one(turn, messages=messages)
                recs.append(rec)
                if not rec.ok:
                    break  # the rest of this conversation would not be the same workload
                reply = canned.get(turn.id, rec.text)  # canned: random weights (workload.py)
                messages = [*messages, {"role": "assistant", "content": reply}]
        after = await self.worker_stats()
        extra: dict[str, Any] = {}
        if before is not None and after is not None:
            extra["prefix_cache_before"] = before.get("prefix_cache")
            extra["prefix_cache_after"] = after.get("prefix_cache")
        return {"waves": [self._wave(recs, t0)], "extra": extra}

    async def _mixed(self, s: Scenario, t0: float) -> dict[str, Any]:
        streams = s.groups["streams"]
        steady_tokens = int(s.params["steady_tokens"])
        counts: dict[str, int] = {}
        ready = asyncio.Event()

        def on_event(rec: RequestRecord) -> None:
            counts[rec.id] = sum(n for _, n in rec.events)
            if len(counts) == len(streams) and min(counts.values()) >= steady_tokens:
                ready.set()

        all_done = asyncio.ensure_future(
            asyncio.gather(*(self._one(r, on_event=on_event) for r in streams))
        )
        waiter = asyncio.ensure_future(ready.wait())
        # Bounded: the streams finish (or fail) by themselves.
        pending: set[asyncio.Future[Any]] = {waiter, all_done}
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED, timeout=self.timeout_s)
        waiter.cancel()
        arrival = time.monotonic()
        long_rec = await self._one(s.groups["long"][0])
        recs = list(await all_done)
        extra: dict[str, Any] = {
            "arrival": round(arrival - t0, 6),
            "streams_ready": ready.is_set(),
            "long_id": long_rec.id,
            "idle_long_ttft_s": self.idle_long_ttft_s,
        }
        return {"waves": [self._wave([*recs, long_rec], t0)], "extra": extra}

    async def _slow_readers(self, s: Scenario, t0: float) -> dict[str, Any]:
        async with make_session(recv_buffer=SLOW_READER_RCVBUF) as slow_session:
            slow = [self._one(r, session=slow_session) for r in s.groups["slow"]]
            fast = [self._one(r) for r in s.groups["fast"]]
            recs = list(await asyncio.gather(*slow, *fast))
        return {
            "waves": [self._wave(recs, t0)],
            "extra": {
                "slow_ids": [r.id for r in s.groups["slow"]],
                "recv_buffer": SLOW_READER_RCVBUF,
            },
        }

    async def _cancel(self, s: Scenario, t0: float) -> dict[str, Any]:
        metrics_before = await self.metrics_text()
        stop = asyncio.Event()
        counts: dict[str, int] = {}
        bg_specs = s.groups["background"]
        ready = asyncio.Event()

        def on_event(rec: RequestRecord) -> None:
            counts[rec.id] = len(rec.events)
            if len(counts) == len(bg_specs) and min(counts.values()) >= 2:
                ready.set()

        bg = [asyncio.create_task(self._one(r, on_event=on_event, stop=stop)) for r in bg_specs]
        if bg:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), self.timeout_s)
        steps: list[float] = []
        recs: list[RequestRecord] = []
        for spec in s.groups["cancel"]:
            w = await self.worker_stats()
            if w is not None and w.get("decode_step_s"):
                steps.append(float(w["decode_step_s"]))
            hist = await self._cancel_histogram()
            delay = None
            if spec.cancel_in_prefill is not None:
                delay = spec.cancel_in_prefill * (self.idle_long_ttft_s or 0.1)
            rec = await self._one(spec, prefill_cancel_after_s=delay)
            if rec.cancelled_at is not None and w is not None:
                rec.cancel_to_retire_s, rec.cancel_poll_rtt_s = await self._retired(
                    w, rec.cancelled_at
                )
            if rec.cancelled_at is not None and hist is not None:
                rec.server_cancel_to_retire_s = await self._server_retired(hist)
            recs.append(rec)
        metrics_after = await self.metrics_text()  # before the background streams leave
        stop.set()
        bg_recs = list(await asyncio.gather(*bg))
        extra: dict[str, Any] = {
            "stage": s.params["stage"],
            "decode_step_s": percentile(steps, 50),
            "background_ids": [r.id for r in bg_specs],
            "poll_rtt_idle_s": await self._poll_rtt(),
        }
        if metrics_before is not None and metrics_after is not None:
            extra["gateway_cancel_to_retire"] = histogram_delta(
                metrics_before, metrics_after, CANCEL_HISTOGRAM
            )
            extra["gateway_cancel_stages"] = counter_delta(
                metrics_before, metrics_after, "mlxd_cancellations_total", "stage"
            )
        return {"waves": [self._wave([*recs, *bg_recs], t0)], "extra": extra}

    async def _retired(
        self, before: dict[str, Any], cancelled_at: float
    ) -> tuple[float | None, float | None]:
        """Poll the worker until it counts the abort: (upper bound of the latency, poll RTT).

        (None, None) when the request never reached the worker (the gateway dropped
        it while tokenizing or queued) or the abort was not seen in time.
        """
        aborted = int(before.get("requests_aborted", 0))
        added = int(before.get("requests_added", 0))
        unsubmitted_polls = 0
        deadline = cancelled_at + RETIRE_POLL_TIMEOUT_S
        while time.monotonic() < deadline:
            sent = time.monotonic()
            w = await self.worker_stats()
            got = time.monotonic()
            if w is None:
                continue
            if int(w.get("requests_aborted", 0)) > aborted:
                return got - cancelled_at, got - sent
            if int(w.get("requests_added", 0)) <= added:
                unsubmitted_polls += 1
                if unsubmitted_polls >= 2:
                    return None, None
        return None, None

    async def _cancel_histogram(self) -> dict[str, Any] | None:
        text = await self.metrics_text()
        return None if text is None else parse_histogram(text, CANCEL_HISTOGRAM)

    async def _server_retired(self, before: dict[str, Any]) -> float | None:
        """mlxd's own cancellation-to-retirement of the one request just cancelled.

        The gateway observes it when the worker's terminal output for the aborted
        request arrives; cancellations here are one at a time, so the histogram's
        sum grows by exactly this request's latency.
        """
        deadline = time.monotonic() + RETIRE_POLL_TIMEOUT_S
        while time.monotonic() < deadline:
            after = await self._cancel_histogram()
            if after is None:
                return None
            if after["count"] > before["count"]:
                if after["count"] - before["count"] != 1:
                    return None  # someone else's cancellation too: not attributable
                return float(after["sum"] - before["sum"])
            await asyncio.sleep(0.01)
        return None

    async def _poll_rtt(self, n: int = 5) -> float | None:
        if not self.has_stats:
            return None
        rtts = []
        for _ in range(n):
            t = time.monotonic()
            await self.worker_stats()
            rtts.append(time.monotonic() - t)
        return percentile(rtts, 50)


_HIST_LINE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def parse_histogram(text: str, name: str) -> dict[str, Any]:
    """Cumulative buckets (le -> count), sum and count of one histogram, all label sets summed."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for line in text.splitlines():
        m = _HIST_LINE.match(line.strip())
        if not m or not m["name"].startswith(name):
            continue
        value = float(m["value"])
        suffix = m["name"][len(name) :]
        if suffix == "_bucket":
            le = re.search(r'le="([^"]+)"', m["labels"] or "")
            if le:
                key = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
                buckets[key] = buckets.get(key, 0.0) + value
        elif suffix == "_sum":
            total += value
        elif suffix == "_count":
            count += value
    return {"buckets": buckets, "sum": total, "count": count}


def histogram_delta(before: str, after: str, name: str) -> dict[str, Any]:
    """Count, mean and bucket-bound p50/p99 of the observations between two scrapes."""
    a, b = parse_histogram(before, name), parse_histogram(after, name)
    count = b["count"] - a["count"]
    out: dict[str, Any] = {"count": int(count), "mean_s": None, "p50_le_s": None, "p99_le_s": None}
    if count <= 0:
        return out
    out["mean_s"] = (b["sum"] - a["sum"]) / count
    les = sorted(b["buckets"])
    for q, key in ((0.5, "p50_le_s"), (0.99, "p99_le_s")):
        for le in les:
            if b["buckets"][le] - a["buckets"].get(le, 0.0) >= q * count:
                out[key] = None if le == float("inf") else le
                break
    return out


def counter_delta(before: str, after: str, name: str, label: str) -> dict[str, int]:
    """Increase of a counter between two scrapes, by one label's value."""

    def read(text: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = _HIST_LINE.match(line.strip())
            if not m or m["name"] != name:
                continue
            lv = re.search(label + r'="([^"]*)"', m["labels"] or "")
            key = lv.group(1) if lv else ""
            out[key] = out.get(key, 0.0) + float(m["value"])
        return out

    a, b = read(before), read(after)
    return {k: int(v - a.get(k, 0.0)) for k, v in b.items() if v - a.get(k, 0.0)}
