"""`bench run --interleave`: every target alive at once, their waves alternated.

Owns the order of an interleaved run. A plain run (bench/run.py) measures one
target after another, minutes apart. On the lent H200 the same decode step
moved between 6.5 and 10.6 ms within one process from one few-second rep to
the next (session 7, docs/benchmarks/README.md), so a ratio of two targets
measured minutes apart carries that drift. Here:

1. every target starts and warms up first, one at a time (the in-process ones
   as `WaveProcess` children that run waves on command, the servers with their
   warm-up waves), then waits idle;
2. for each scenario every target runs (a kind in PAIRED_KINDS: the sweep, the
   idle long prefill, sustained decode), wave i runs on every target back to
   back, the order rotated by one target per wave so that none always goes
   first, while the others wait; a ratio is then one of waves measured seconds
   apart, and the spreads pair them wave by wave (analysis.ratio_spread);
3. the servers' own scenarios follow (nonstream, shared prefix, mixed
   pressure, cancellations, slow readers), one server at a time, as in a plain
   run; then every target stops.

With a deadline (`bench run --deadline-s`), no wave or scenario starts past
it: a paired scenario keeps the waves every target ran, the rest are listed
as cut, and the targets stop and report as usual. A lent GPU's session ends
on the dot, and a run killed at its limit would leave nothing.

Each target's data has the shape a plain run gives it, so analysis and report
are the same; results.json adds "interleave" (the order each wave ran in, on
the monotonic clock, which every process on the machine shares).

The results are written at the end only, so a run that dies first (a lent
machine taken back mid-run: session 13) would leave nothing. The journal
(`waves.jsonl` in the output directory) gets one line per wave as it ends:
scenario, wave, target, start and end, the wave's output tokens (its
requests' max_tokens, which the benchmark's workload always reaches unless a
request fails) and their rate; and one line per target dropped, with why.
Enough to read each level's throughput ratios from a run that never finished.

Threading: one asyncio loop in the bench process; the children are driven over
pipes, the servers over HTTP. A target that fails to start or run is dropped
into "skipped" and the others go on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.ceiling import WaveProcess
from bench.client import Target, make_session
from bench.progress import Progress
from bench.scenarios import Started, TargetRunner
from bench.servers import ServerProcess, stop
from bench.workload import PAIRED_KINDS, Scenario, Workload

StartChild = Callable[[str], Awaitable[WaveProcess]]
StartServer = Callable[[str], tuple[ServerProcess, Target]]  # blocking: run in a thread


@dataclass(slots=True)
class _Server:
    server: ServerProcess
    runner: TargetRunner
    before: dict[str, Any] = field(default_factory=dict)  # resting state after warm-up
    scenarios: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Run:
    workload: Workload
    progress: Progress
    order: list[str]  # every target, in the run's fixed order (rotated per wave)
    children: dict[str, WaveProcess] = field(default_factory=dict)
    servers: dict[str, _Server] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)
    turn: int = 0  # waves run so far: who goes first next
    deadline: float | None = None  # time.monotonic() past which nothing starts
    cut: list[str] = field(default_factory=list)  # scenarios the deadline cut short
    journal: Path | None = None  # waves.jsonl (module docstring)

    def record(self, entry: dict[str, Any], output_tokens: int) -> None:
        """One wave that ran: into the log, and as it ends into the journal."""
        self.log.append(entry)
        seconds = entry["end"] - entry["start"]
        rate = round(output_tokens / seconds, 3) if seconds > 0 else None
        self._journal({**entry, "output_tokens": output_tokens, "tok_s": rate})

    def _journal(self, line: dict[str, Any]) -> None:
        if self.journal is not None:
            with self.journal.open("a") as f:
                f.write(json.dumps(line) + "\n")

    def out_of_time(self, what: str) -> bool:
        """Whether the deadline has passed; `what` (a scenario, or a target's
        scenario) is then recorded as cut."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return False
        if what not in self.cut:
            self.cut.append(what)
            self.progress.note(f"bench: deadline passed, {what} cut")
        return True

    def live(self) -> list[str]:
        return [n for n in self.order if n in self.children or n in self.servers]

    async def drop(self, name: str, e: BaseException) -> None:
        self.skipped[name] = f"failed: {type(e).__name__}: {e}"
        self._journal({"dropped": name, "why": self.skipped[name], "at": time.monotonic()})
        self.progress.note(f"bench: {name} failed: {e}")
        child = self.children.pop(name, None)
        if child is not None:
            await child.kill()
        srv = self.servers.pop(name, None)
        if srv is not None:
            await asyncio.to_thread(stop, srv.server)


async def run_interleaved(
    names: list[str],
    workload: Workload,
    in_process: tuple[str, ...],
    start_child: StartChild,
    start_server: StartServer,
    progress: Progress,
    deadline: float | None = None,
    journal: Path | None = None,
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """Returns (each target's data, the targets skipped and why, the wave order
    and the scenarios the deadline cut); `journal`: waves.jsonl, started anew."""
    if journal is not None:
        journal.write_text("")
    run = _Run(workload, progress, list(names), deadline=deadline, journal=journal)
    quiet = Progress(1, enabled=False)  # the runners' own steps would interleave too
    async with make_session() as session:
        try:
            for name in names:
                progress.begin(f"{name}: starting and warming up", 1)
                try:
                    if name in in_process:
                        run.children[name] = await start_child(name)
                    else:
                        server, target = await asyncio.to_thread(start_server, name)
                        srv = run.servers[name] = _Server(
                            server, TargetRunner(target, server, workload, quiet)
                        )
                        srv.before = await srv.runner.open(session)  # registered: drop stops it
                except Exception as e:
                    await run.drop(name, e)
                progress.end()
            for s in workload.scenarios:
                if s.kind in PAIRED_KINDS:
                    await _paired(run, s)
            for name, srv in list(run.servers.items()):
                try:
                    for s in workload.scenarios:
                        if s.kind not in PAIRED_KINDS and not run.out_of_time(f"{name} {s.name}"):
                            progress.begin(f"{name} {s.name}", 1)
                            srv.scenarios[s.name] = await srv.runner.scenario(s)
                            progress.end()
                except Exception as e:  # one server failing must not lose the others
                    await run.drop(name, e)
            return await _finish(run), run.skipped, {"waves": run.log, "cut": run.cut}
        finally:
            for name in list(run.children):
                await run.children.pop(name).kill()
            for name in list(run.servers):
                await asyncio.to_thread(stop, run.servers.pop(name).server)


async def _paired(run: _Run, s: Scenario) -> None:
    """Scenario `s` on every live target, wave by wave, the order rotated per wave;
    past the deadline it ends after the last wave every target ran."""
    if run.out_of_time(s.name):
        return
    run.progress.begin(f"{s.name} on {', '.join(run.live())}, wave by wave", 1)
    started: dict[str, Started] = {}
    for name, srv in run.servers.items():
        started[name] = await srv.runner.begin(s)
    waves: dict[str, list[dict[str, Any]]] = {name: [] for name in run.servers}
    specs = s.waves()
    for i in range(len(specs)):
        tokens = sum(r.max_tokens for r in specs[i])
        if i and run.out_of_time(s.name):
            break
        live = run.live()
        k = run.turn % len(live) if live else 0
        run.turn += 1  # over the whole run: one-wave scenarios rotate too
        for name in live[k:] + live[:k]:
            t = time.monotonic()
            try:
                if name in run.children:
                    await run.children[name].wave(s.name, i)
                else:
                    runner = run.servers[name].runner
                    waves[name].append(await runner.wave(s, i, started[name].t0))
            except Exception as e:
                await run.drop(name, e)
                continue
            end = time.monotonic()
            run.record(
                {"scenario": s.name, "wave": i, "target": name, "start": t, "end": end}, tokens
            )
    for name, srv in run.servers.items():
        result = srv.runner.paired(s, waves[name])
        srv.scenarios[s.name] = await srv.runner.end(s, started[name], result)
    run.progress.end()


async def _finish(run: _Run) -> dict[str, Any]:
    """Every target's data, in a plain run's shape; the targets stopped."""
    data: dict[str, Any] = {}
    for name in list(run.children):
        child = run.children.pop(name)
        try:
            data[name] = await child.finish()
        except Exception as e:
            run.skipped[name] = f"failed: {type(e).__name__}: {e}"
            await child.kill()
    for name in list(run.servers):
        srv = run.servers.pop(name)
        ordered = {
            s.name: srv.scenarios[s.name] for s in run.workload.scenarios if s.name in srv.scenarios
        }
        result = await srv.runner.close(ordered, srv.before)
        code = await asyncio.to_thread(stop, srv.server)
        result["server"] = {**srv.server.describe(), "exit_code": code}
        data[name] = result
    return data
