"""Server processes the benchmark starts itself: mlxd (`python -m gateway.cli serve`).

Owns: picking a free loopback port, starting the process with a clean,
recorded environment (no inherited `MLXD_*` variables, an empty config file, so
a developer's ~/.config/mlxd cannot change the numbers), waiting for readiness,
stopping it (SIGTERM, grace period, SIGKILL; only the process it started), and
reading process RSS from /proc. The peer (mlx_lm.server) lives in bench/peer.py
and reuses these pieces.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


@dataclass(slots=True)
class ServerProcess:
    name: str
    url: str
    model: str  # the "model" field requests carry
    proc: subprocess.Popen[bytes] | None = None  # None: a server we did not start
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # what we set (not the whole env)
    startup_s: float | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "model": self.model,
            "argv": self.argv,
            "env": self.env,
            "startup_s": self.startup_s,
            "started_by_bench": self.proc is not None,
            "log": str(self.log_path) if self.log_path else None,
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    """(status, parsed JSON or text); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # loopback URLs only
            raw = r.read().decode(errors="replace")
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(errors="replace"), e.code
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def wait_ready(server: ServerProcess, path: str, timeout_s: float) -> Any:
    """Poll `path` until it answers 200; raise if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.proc.returncode} while "
                f"starting; see {server.log_path}:\n{tail(server.log_path)}"
            )
        status, body = http_get(server.url + path, timeout_s=2.0)
        if status == 200:
            return body
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{server.name} not ready after {timeout_s:g} s; see "
                f"{server.log_path}:\n{tail(server.log_path)}"
            )
        time.sleep(0.1)


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def spawn(
    name: str, argv: list[str], env_extra: dict[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            argv, cwd=ROOT, env=clean_env(env_extra), stdout=log, stderr=subprocess.STDOUT
        )


def start_mlxd(
    model_dir: Path,
    work_dir: Path,
    *,
    max_batch: int,
    timeout_s: float = 900.0,
    trace_file: Path | None = None,
    env_extra: dict[str, str] | None = None,
) -> ServerProcess:
    """`python -m gateway.cli serve` on a free loopback port, with default settings
    except the batch size (it must hold the workload's largest concurrency)."""
    port = free_port()
    config = work_dir / "mlxd-bench.toml"
    config.write_text("# empty: the benchmark measures mlxd's defaults\n")
    argv = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--config",
        str(config),
        "--model",
        str(model_dir),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
    ]
    if trace_file is not None:
        argv += ["--trace-file", str(trace_file)]
    env = {"MLXD_MAX_BATCH": str(max_batch), "MLXD_MAX_QUEUED": str(max(128, 4 * max_batch))}
    env.update(env_extra or {})
    log = work_dir / "mlxd.log"
    start = time.monotonic()
    server = ServerProcess(
        "mlxd", f"http://{LOOPBACK}:{port}", "", spawn("mlxd", argv, env, log), log, argv, env
    )
    try:
        body = wait_ready(server, "/ready", timeout_s)
    except BaseException:
        stop(server)
        raise
    server.startup_s = time.monotonic() - start
    server.model = body["model"]
    return server


def attach_mlxd(url: str) -> ServerProcess:
    """A running mlxd at `url` (loopback only): its served model from /ready."""
    status, body = http_get(url.rstrip("/") + "/ready")
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"{url}/ready answered {status}: {body}")
    return ServerProcess("mlxd", url.rstrip("/"), body["model"])


def stop(server: ServerProcess, grace_s: float = 30.0) -> int | None:
    """Stop a process we started: SIGTERM, then SIGKILL after the grace period."""
    proc = server.proc
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def cpu_seconds(pid: int | None) -> float | None:
    """User plus system CPU time a process has used so far (Linux /proc); None elsewhere."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # Fields after the command name, which may hold spaces: utime, stime are 14, 15.
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of a process (Linux /proc); None elsewhere."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
