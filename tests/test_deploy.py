"""deploy/: the launchd and systemd templates, render.py, the example config, make targets."""

from __future__ import annotations

import configparser
import importlib.util
import os
import plistlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelEntry, Settings, load_settings
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
RENDER = ROOT / "deploy" / "render.py"
EXAMPLE = ROOT / "deploy" / "mlxd.toml.example"
PLACEHOLDER = re.compile(r"@[A-Za-z_]+@")


def render(tmp_path: Path, kind: str, *args: str) -> tuple[Path, str]:
    """Run render.py as `make` does; return the output file and render.py's stderr."""
    out = tmp_path / ("com.mlxd.server.plist" if kind == "launchd" else "mlxd.service")
    proc = subprocess.run(
        [sys.executable, str(RENDER), kind, "--out", str(out), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return out, proc.stderr


def read_unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string(path.read_text())
    return unit


def stop_budget_s() -> float:
    """The gateway's longest graceful stop: drain, then the worker's two grace periods."""
    fields = Settings.model_fields
    return float(fields["shutdown_grace_s"].default) + 2 * float(
        fields["worker_stop_grace_s"].default
    )


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "conf dir" / "mlxd.toml"  # a space: quoting must hold
    path.parent.mkdir()
    shutil.copy(EXAMPLE, path)
    return path


def test_launchd_plist(tmp_path: Path, config: Path) -> None:
    out, _ = render(tmp_path, "launchd", "--config", str(config))
    text = out.read_text()
    assert not PLACEHOLDER.search(text), PLACEHOLDER.findall(text)
    plist = plistlib.loads(text.encode())

    assert plist["Label"] == "com.mlxd.server"
    args = plist["ProgramArguments"]
    assert Path(args[0]).is_absolute() and args[0].endswith("/mlxd")
    assert os.access(args[0], os.X_OK)
    assert args[1:] == ["serve", "--config", str(config)]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert type(plist["ThrottleInterval"]) is int and plist["ThrottleInterval"] == 10
    assert type(plist["ExitTimeOut"]) is int and plist["ExitTimeOut"] > stop_budget_s()
    assert plist["ProcessType"] in {"Interactive", "Standard"}
    assert plist["SoftResourceLimits"] == {"NumberOfFiles": 4096}
    assert Path(plist["WorkingDirectory"]).is_dir()
    env = plist["EnvironmentVariables"]
    assert env["PATH"].split(":")[0] == str(Path(args[0]).parent)
    assert env["HOME"] == str(Path.home())
    for key in ("StandardOutPath", "StandardErrorPath"):
        log = Path(plist[key])
        assert log.is_absolute() and log.parent.parts[-3:] == ("Library", "Logs", "mlxd")


def test_systemd_unit(tmp_path: Path, config: Path) -> None:
    out, _ = render(tmp_path, "systemd", "--config", str(config))
    text = out.read_text()
    assert not PLACEHOLDER.search(text), PLACEHOLDER.findall(text)
    unit = read_unit(out)

    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    assert unit["Unit"]["Description"]
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).is_absolute() and argv[0].endswith("/mlxd")
    assert argv[1:] == ["serve", "--config", str(config)]
    assert service["Type"] == "simple"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "78"
    assert service["KillMode"] == "mixed"
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > stop_budget_s()
    assert service["LimitNOFILE"] == "4096"
    assert service["NoNewPrivileges"] == "true"
    assert unit["Install"]["WantedBy"] == "default.target"


def test_stop_timeout_follows_the_config(tmp_path: Path, config: Path) -> None:
    config.write_text("shutdown_grace_s = 120\nworker_stop_grace_s = 10\n")
    out, _ = render(tmp_path, "systemd", "--config", str(config))
    assert int(read_unit(out)["Service"]["TimeoutStopSec"]) > 120 + 2 * 10


def test_render_defaults_match_gateway_settings() -> None:
    spec = importlib.util.spec_from_file_location("mlxd_deploy_render", RENDER)
    assert spec is not None and spec.loader is not None
    render_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_mod)
    fields = Settings.model_fields
    assert fields["shutdown_grace_s"].default == render_mod.SHUTDOWN_GRACE_S
    assert fields["worker_stop_grace_s"].default == render_mod.WORKER_STOP_GRACE_S


def test_render_to_stdout_warns_about_a_missing_config(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    proc = subprocess.run(
        [sys.executable, str(RENDER), "systemd", "--config", str(missing)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"--config {missing}" in proc.stdout
    assert "does not exist" in proc.stderr


def test_systemd_analyze_verify(tmp_path: Path, config: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # An mlxd path with a space and a '%' exercises ExecStart quoting and escaping.
    odd = tmp_path / "odd dir %i"
    odd.mkdir()
    mlxd = odd / "mlxd"
    shutil.copy(ROOT / ".venv" / "bin" / "mlxd", mlxd)
    for extra in ([], ["--mlxd", str(mlxd)]):
        out, _ = render(tmp_path, "systemd", "--config", str(config), *extra)
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
        proc = subprocess.run(
            [analyze, "--user", "verify", str(out)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if "Failed to initialize manager" in proc.stderr:  # no user manager possible here
            proc = subprocess.run(
                [analyze, "verify", str(out)], capture_output=True, text=True, check=False
            )
        assert proc.returncode == 0, proc.stderr
        # verify exits 0 on unknown keys and bad values, but names the file.
        complaints = [line for line in proc.stderr.splitlines() if "mlxd.service" in line]
        assert not complaints, complaints
        if extra:
            exec_start = read_unit(out)["Service"]["ExecStart"]
            assert shlex.split(exec_start.replace("%%", "%"))[0] == str(mlxd)


def test_example_config_loads_and_names_real_settings(tmp_path: Path) -> None:
    settings = load_settings(EXAMPLE)
    assert settings.port == 8000 and settings.model == "default"
    # Uncomment every `# key = value` line: each must name a current setting.
    keys = {
        m[1]
        for line in EXAMPLE.read_text().splitlines()
        if (m := re.match(r"#?\s*(\w+)\s*=", line))
    }
    table_keys = {"key", "name", "scopes"}  # inside [[api_keys]]
    table_keys |= set(ModelEntry.model_fields)  # inside [[models]]
    unknown = keys - table_keys - set(Settings.model_fields)
    assert not unknown, f"the example names settings that do not exist: {unknown}"
    assert {"host", "port", "model", "shutdown_grace_s"} <= keys


def test_make_targets_render_into_home(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    home = tmp_path / "home"
    home.mkdir()
    out = {}
    for target in ("deploy-launchd", "deploy-systemd"):
        # -o setup: the venv exists already (this test runs in it); do not rebuild it.
        proc = subprocess.run(
            ["make", "-s", "-o", "setup", target, f"HOME={home}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[target] = proc.stdout
    config = home / ".config" / "mlxd" / "mlxd.toml"
    assert config.read_text() == EXAMPLE.read_text()
    assert config.stat().st_mode & 0o777 == 0o600
    assert (home / "Library" / "Logs" / "mlxd").is_dir()
    plist = plistlib.loads((home / "Library/LaunchAgents/com.mlxd.server.plist").read_bytes())
    assert plist["ProgramArguments"][-1] == str(config)
    unit = read_unit(home / ".config/systemd/user/mlxd.service")
    assert unit["Service"]["ExecStart"].endswith(f"--config {config}")
    plist_path = home / "Library/LaunchAgents/com.mlxd.server.plist"
    assert f'launchctl bootstrap gui/{os.getuid()} "{plist_path}"' in out["deploy-launchd"]
    assert (
        "systemctl --user daemon-reload && systemctl --user enable --now mlxd"
        in out["deploy-systemd"]
    )


def _children(pid: int) -> list[int]:
    proc = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in proc.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _ps(pid: int) -> str:
    proc = subprocess.run(
        ["ps", "-o", "pid,ppid,stat,args", "-p", str(pid)],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout


def _start_rendered(
    tmp_path: Path, config: Path, model: Path
) -> tuple[subprocess.Popen[bytes], int, str]:
    """Start the unit's own ExecStart (plus a test model and port): (gateway, worker pid, url)."""
    out, _ = render(tmp_path, "systemd", "--config", str(config))
    port = free_port()
    argv = [
        *shlex.split(read_unit(out)["Service"]["ExecStart"]),
        "--model",
        str(model),
        "--port",
        str(port),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=dict(env, PYTHONUNBUFFERED="1"), stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
        time.sleep(0.1)
    workers = _children(proc.pid)
    assert len(workers) == 1, workers
    return proc, workers[0], url


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="pgrep is not installed")
def test_sigterm_is_a_clean_exit_within_the_stop_timeout(
    tmp_path: Path, config: Path, tiny_model_dir: Path
) -> None:
    """What the service manager sees on stop: exit 0 (no restart), worker gone, in time."""
    proc, worker, _ = _start_rendered(tmp_path, config, tiny_model_dir)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(stop_budget_s() + 5) == 0  # launchd/systemd: successful, stays down
        # The gateway waits for its worker before it exits.
        assert not _alive(worker), _ps(worker) + (tmp_path / "serve.log").read_text()
    finally:
        proc.kill()


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="pgrep is not installed")
def test_worker_exits_when_the_gateway_dies(
    tmp_path: Path, config: Path, tiny_model_dir: Path
) -> None:
    """SIGKILL to the gateway (e.g. at TimeoutStopSec) leaves no orphan worker holding the model."""
    proc, worker, _ = _start_rendered(tmp_path, config, tiny_model_dir)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the worker outlived its gateway"
