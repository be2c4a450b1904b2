"""Configuration: sources and precedence, one-line errors with exit code 78, docs coverage."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, ModelEntry, Settings, load_settings
from protocol import exit_codes
from protocol.worker_config import DEFAULTS, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("MLXD_"):
            monkeypatch.delenv(name)
    # A developer's own ~/.config/mlxd/mlxd.toml must not leak into these tests.
    monkeypatch.setenv("HOME", str(tmp_path))


def test_every_setting_is_documented() -> None:
    doc = DOC.read_text()
    missing = [
        name
        for name in Settings.model_fields
        if f"`{name}`" not in doc or f"`MLXD_{name.upper()}" not in doc
    ]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_documented_defaults_match_the_code() -> None:
    doc = DOC.read_text()
    rows = re.findall(r"^\| `(\w+)` \| `MLXD_\w+`[^|]*\| ([^|]+) \|", doc, re.M)
    assert len(rows) == len(Settings.model_fields)
    for name, default in rows:
        value = Settings.model_fields[name].default
        if isinstance(value, bool):
            assert f"`{str(value).lower()}`" in default, name
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            shown = re.search(r"`([\d.]+)`", default)
            assert shown is not None and float(shown[1]) == value, (name, default)
        elif isinstance(value, str) and value:
            assert f"`{value}`" in default, (name, default)


def test_precedence_file_env_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "mlxd.toml"
    cfg.write_text(
        'port = 9001\nmax_queued = 7\nlog_level = "debug"\n'
        '[[api_keys]]\nkey = "sk-from-file-123"\nscopes = ["admin"]\nname = "ops"\n'
    )
    s = load_settings(cfg)
    assert (s.port, s.max_queued, s.log_level) == (9001, 7, "debug")
    assert [(k.name, sorted(k.scopes)) for k in s.api_keys] == [("ops", ["admin"])]
    monkeypatch.setenv("MLXD_PORT", "9002")
    monkeypatch.setenv("MLXD_MAX_QUEUED", "8")
    s = load_settings(cfg)
    assert (s.port, s.max_queued, s.log_level) == (9002, 8, "debug")
    s = load_settings(cfg, port=9003, cli_api_keys=["sk-from-cli-456"])
    assert (s.port, s.max_queued) == (9003, 8)
    # --api-key adds to the configured keys, with every scope.
    assert [(k.label, sorted(k.scopes)) for k in s.api_keys] == [
        ("ops", ["admin"]),
        ("cli-1", ["admin", "inference"]),
    ]
    with pytest.raises(Exception):  # noqa: B017 - frozen: any mutation fails
        s.port = 1  # type: ignore[misc]


def test_default_config_file_is_used_when_present(tmp_path: Path) -> None:
    home_cfg = tmp_path / ".config" / "mlxd" / "mlxd.toml"
    home_cfg.parent.mkdir(parents=True)
    home_cfg.write_text("max_batch = 4\n")
    assert load_settings().max_batch == 4


def test_keys_never_appear_in_repr_or_dumps() -> None:
    s = load_settings(cli_api_keys=["sk-super-secret-1"])
    assert "sk-super-secret-1" not in repr(s)
    assert "sk-super-secret-1" not in str(s.model_dump())
    assert "sk-super-secret-1" not in s.model_dump_json()


@pytest.mark.parametrize(
    ("kwargs", "env", "field"),
    [
        ({"port": 70000}, {}, "port"),
        ({}, {"MLXD_PORT": "abc"}, "port"),
        ({}, {"MLXD_MAX_QUEUED": "-1"}, "max_queued"),
        ({}, {"MLXD_API_KEYS": "not json"}, "api_keys"),
        ({}, {"MLXD_API_KEYS": '[{"key": "short", "scopes": ["admin"]}]'}, "api_keys.0.key"),
        ({}, {"MLXD_API_KEYS": '[{"key": "sk-0123456789", "scopes": ["root"]}]'}, "api_keys"),
        ({}, {"MLXD_API_KEYS": '[{"key": "sk-0123456789"}]'}, "api_keys.0.scopes"),
        ({"retry_after_min_s": 90}, {}, "retry_after_min_s"),
        ({"host": "0.0.0.0"}, {}, "host"),
        ({"log_level": "loud"}, {}, "log_level"),
        ({}, {"MLXD_FUSED_STEP": "sometimes"}, "fused_step"),
        ({}, {"MLXD_DECODE_ROWS": "yes"}, "decode_rows"),
        ({}, {"MLXD_PROMPT_ATTENTION": "true"}, "prompt_attention"),  # auto, on or off
        ({}, {"MLXD_PACING_SLACK": "0.5"}, "pacing_slack"),  # under the smallest chunk's cost
        ({}, {"MLXD_PACING_FACTOR": "0.5"}, "pacing_factor"),  # 0 is the backend's; else > 1
        ({}, {"MLXD_PACING_FACTOR": "1"}, "pacing_factor"),  # no room for a prompt at all
        ({}, {"MLXD_PACING_FACTOR": "-2"}, "pacing_factor"),
        ({}, {"MLXD_PACING_FACTOR": "nan"}, "pacing_factor"),
        ({"fused_step": "x" * 10_000}, {}, "fused_step"),
        ({}, {"MLXD_ARRIVAL_WINDOW_S": "-0.001"}, "arrival_window_s"),
        ({}, {"MLXD_ARRIVAL_WINDOW_S": "5"}, "arrival_window_s"),  # a request held seconds
        ({}, {"MLXD_ARRIVAL_WINDOW_S": "nan"}, "arrival_window_s"),
        ({}, {"MLXD_ARRIVAL_WINDOW_S": "inf"}, "arrival_window_s"),
        ({}, {"MLXD_ARRIVAL_QUIET_S": "-0.001"}, "arrival_quiet_s"),
        ({}, {"MLXD_ARRIVAL_QUIET_S": "1"}, "arrival_quiet_s"),  # every idle start held 4 s
        ({}, {"MLXD_ARRIVAL_QUIET_S": "nan"}, "arrival_quiet_s"),
        ({}, {"MLXD_KERNEL_WARM": "sometimes"}, "kernel_warm"),
        ({}, {"MLXD_HOST_PADDING": "[]"}, "host_padding"),
        ({}, {"MLXD_ADMISSION_COST": "2"}, "admission_cost"),
    ],
)
def test_invalid_settings_name_the_field(
    kwargs: dict, env: dict, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        load_settings(**kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"invalid setting '{field}") or f"'{field}" in msg, msg
    for v in env.values():
        if "sk-" in v:
            assert "sk-0123456789" not in msg


def test_remote_bind_needs_keys_or_explicit_opt_out() -> None:
    with pytest.raises(ConfigError, match="'host'"):
        load_settings(host="0.0.0.0")
    assert load_settings(host="0.0.0.0", allow_unauthenticated_remote=True).host == "0.0.0.0"
    assert load_settings(host="0.0.0.0", cli_api_keys=["sk-0123456789"]).host == "0.0.0.0"
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert load_settings(host=host).host == host


def _serve(args: list[str], env: dict[str, str], home: Path) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    full_env.update(env, HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", "/nonexistent", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "env", "field"),
    [
        (["--host", "0.0.0.0"], {}, "host"),
        ([], {"MLXD_PORT": "abc"}, "port"),
        (["--config", "{bad}"], {}, "config"),
    ],
)
def test_serve_exits_78_with_one_line(
    args: list[str], env: dict[str, str], field: str, tmp_path: Path
) -> None:
    if "{bad}" in args:
        bad = tmp_path / "bad.toml"
        bad.write_text("max_batch = [\n")
        args = [str(bad) if a == "{bad}" else a for a in args]
    r = _serve(args, env, tmp_path)
    assert r.returncode == exit_codes.BAD_CONFIG, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("mlxd: ") and field in lines[0]
    assert r.stdout == ""


def test_worker_knob_defaults_live_once_in_the_launch_contract() -> None:
    # Settings' worker knobs default to WorkerConfig's: a default Settings builds
    # exactly the default launch contract (protocol/worker_config.DEFAULTS).
    cfg = Settings().worker_config(socket="/tmp/w.sock", epoch=3)
    assert cfg == dataclasses.replace(DEFAULTS, socket="/tmp/w.sock", epoch=3)


def test_each_models_worker_config_carries_its_own_settings(tmp_path: Path) -> None:
    s = Settings(
        max_batch=4, prefill_chunk=64, prefix_cache_bytes=0, group_size=2, admission_cost=False
    )
    entry = ModelEntry(name="m", path=str(tmp_path), group_size=1, memory_bytes=1 << 30)
    cfg = s.for_model(entry, 1 << 30).worker_config(socket="/s", epoch=1)
    assert (cfg.model, cfg.model_id, cfg.max_batch, cfg.prefill_chunk) == (
        str(tmp_path),
        "m",
        4,
        64,
    )
    assert (cfg.prefix_cache_bytes, cfg.group_size, cfg.memory_budget_bytes) == (0, 1, 1 << 30)
    assert not cfg.admission_cost  # not the default (on): carried, not defaulted
    assert WorkerConfig.from_argv(cfg.to_argv()) == cfg  # what the worker parses back


def test_the_worker_refuses_an_unknown_fused_step_mode() -> None:
    """The launch contract checks it too (a worker started by hand, not by the gateway)."""
    from protocol.worker_config import WorkerConfig

    good = WorkerConfig(socket="s", model="m", fused_step="on")
    assert WorkerConfig.from_argv(good.to_argv()).fused_step == "on"
    bad = WorkerConfig(socket="s", model="m", fused_step="sometimes")
    with pytest.raises(ValueError, match="fused_step"):
        WorkerConfig.from_argv(bad.to_argv())
    rows = WorkerConfig(socket="s", model="m", decode_rows="on")
    assert WorkerConfig.from_argv(rows.to_argv()).decode_rows == "on"
    with pytest.raises(ValueError, match="decode_rows"):
        WorkerConfig.from_argv(dataclasses.replace(rows, decode_rows="yes").to_argv())
    ours = WorkerConfig(socket="s", model="m", prompt_attention="on")
    assert WorkerConfig.from_argv(ours.to_argv()).prompt_attention == "on"
    with pytest.raises(ValueError, match="prompt_attention"):
        WorkerConfig.from_argv(dataclasses.replace(ours, prompt_attention="true").to_argv())


@pytest.mark.parametrize("factor", [0.5, 1.0, -2.0, 101.0, float("nan"), float("inf")])
def test_the_worker_refuses_a_pacing_factor_with_no_room_for_a_prompt(factor: float) -> None:
    """0 is the backend's factor and above 1 leaves a paced step room for a
    prompt; the launch contract refuses the rest as the gateway's settings do."""
    from protocol.worker_config import WorkerConfig

    for good in (0.0, 3.0):
        cfg = WorkerConfig(socket="s", model="m", pacing_factor=good)
        assert WorkerConfig.from_argv(cfg.to_argv()).pacing_factor == good
    bad = WorkerConfig(socket="s", model="m", pacing_factor=factor)
    with pytest.raises(ValueError, match="pacing_factor"):
        WorkerConfig.from_argv(bad.to_argv())


@pytest.mark.parametrize("quiet", [-0.001, 0.06, float("nan"), float("inf")])
def test_the_worker_refuses_a_hostile_arrival_quiet_period(quiet: float) -> None:
    """An idle worker holds its first step for up to 4 quiet periods: the launch
    contract bounds it as the gateway's settings do."""
    from protocol.worker_config import WorkerConfig

    assert WorkerConfig.from_argv(WorkerConfig(socket="s", model="m").to_argv()).arrival_quiet_s
    bad = WorkerConfig(socket="s", model="m", arrival_quiet_s=quiet)
    with pytest.raises(ValueError, match="arrival_quiet_s"):
        WorkerConfig.from_argv(bad.to_argv())
