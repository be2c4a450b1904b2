"""The gateway's one frozen settings object.

Sources, lowest to highest precedence: field defaults, a TOML file
(`--config`, else `~/.config/mlxd/mlxd.toml` when it exists), `MLXD_*`
environment variables, then CLI flags. Nothing is read at import time:
`load_settings()` is called once by the CLI (or a test) and the result is
passed down explicitly. docs/configuration.md documents every field; a test
keeps the two in step.

Invalid configuration never gets as far as starting anything: `load_settings()`
raises `ConfigError` with one line naming the field, and `mlxd serve` prints it
and exits with `protocol.exit_codes.BAD_CONFIG` (78).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from protocol.worker_config import DEFAULT_MODEL_NAME, DEFAULTS, WorkerConfig

DEFAULT_CONFIG_FILE = Path("~/.config/mlxd/mlxd.toml")

Scope = Literal["inference", "admin"]
ALL_SCOPES: frozenset[str] = frozenset({"inference", "admin"})


class APIKey(BaseModel):
    """One bearer key. A bare string in the config is a key with every scope
    (like `--api-key`); the table form must list its scopes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: SecretStr  # SecretStr: repr() and model dumps print '**********'
    scopes: frozenset[Scope] = Field(min_length=1)
    name: str = ""  # shown in logs and metrics instead of the key; empty: a fingerprint
    rate_limit_rpm: float = Field(0.0, ge=0)  # 0: the server-wide rate_limit_rpm

    @model_validator(mode="before")
    @classmethod
    def _bare_string(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"key": data, "scopes": sorted(ALL_SCOPES)}
        return data

    @field_validator("key")
    @classmethod
    def _long_enough(cls, v: SecretStr) -> SecretStr:
        s = v.get_secret_value()
        if len(s) < 8 or not s.isprintable() or any(c.isspace() for c in s):
            # The message never echoes the key.
            raise ValueError("an API key needs at least 8 printable, non-space characters")
        return v

    @property
    def label(self) -> str:
        """What logs and metrics call this key: its name, else a short fingerprint."""
        if self.name:
            return self.name
        digest = hashlib.sha256(self.key.get_secret_value().encode()).hexdigest()
        return "key-" + digest[:8]


class SamplingProfile(BaseModel):
    """A model's default sampling: applied to each field a request leaves out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)

    def defaults(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ModelEntry(BaseModel):
    """One served model of a multi-model config (`[[models]]` in TOML).

    Each runs in its own worker. `pinned` models start with the gateway and are
    never stopped for idleness or memory; the others start on their first
    request and stop after `idle_timeout_s` without one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1)  # a model directory, or "default" (embedded)
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    idle_timeout_s: float = Field(default=600.0, ge=0)  # 0: never stopped for idleness
    # The worker's memory budget, charged to models_memory_budget_bytes; 0: weights x1.1 + 1 GiB
    memory_bytes: int = Field(default=0, ge=0)
    sampling: SamplingProfile = SamplingProfile()
    # This model's worker group (docs/distributed.md); None: group_size / group_backend.
    group_size: int | None = Field(default=None, ge=1, le=64)
    group_backend: Literal["ring", "nccl"] | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MLXD_", frozen=True, extra="forbid")

    # -- listening
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # -- the model
    model: str = Field("default", description="model directory, or 'default' (embedded)")
    model_name: str = ""  # served id; empty: the directory's name
    cache_dir: str = ""  # default model, (CUDA) MLX's kernels; empty: ~/.cache/mlxd

    # -- several models (gateway/workers/registry.py); empty: the one model above, pinned
    models: tuple[ModelEntry, ...] = ()
    models_memory_budget_bytes: int = Field(0, ge=0)  # 0: 75% of physical memory

    # -- worker engine; defaults: protocol/worker_config.DEFAULTS (the launch contract)
    max_batch: int = Field(DEFAULTS.max_batch, ge=1, le=1024)
    prefill_batch: int = Field(DEFAULTS.prefill_batch, ge=1, le=256)
    prefill_chunk: int = Field(DEFAULTS.prefill_chunk, ge=16)
    prefill_pacing: bool = DEFAULTS.pacing
    pacing_factor: float = Field(DEFAULTS.pacing_factor, ge=0, le=100)  # 0: the backend's
    pacing_slack: float = Field(DEFAULTS.pacing_slack, ge=1, le=10)
    admission_cost: bool = DEFAULTS.admission_cost
    kernel_warm: bool = DEFAULTS.kernel_warm
    host_padding: bool = DEFAULTS.host_padding
    pacing_calibration_s: float = Field(DEFAULTS.pacing_calibration_s, ge=0, le=60)  # 0: none
    cuda_graphs: Literal["auto", "on", "off"] = DEFAULTS.cuda_graphs  # type: ignore[assignment]
    chunk_buckets: str = DEFAULTS.chunk_buckets  # "64,256,1024"; "": the backend's default
    fused_step: Literal["auto", "on", "off"] = DEFAULTS.fused_step  # type: ignore[assignment]
    decode_attention: Literal["auto", "mlx", "ragged"] = DEFAULTS.decode_attention  # type: ignore[assignment]
    decode_rotary: bool = DEFAULTS.decode_rotary
    decode_rows: Literal["auto", "on", "off"] = DEFAULTS.decode_rows  # type: ignore[assignment]
    idle_read: bool = DEFAULTS.idle_read
    join_read: bool = DEFAULTS.join_read
    prompt_attention: Literal["auto", "on", "off"] = DEFAULTS.prompt_attention  # type: ignore
    arrival_quiet_s: float = Field(DEFAULTS.arrival_quiet_s, ge=0, le=0.05)
    step_trace: str = DEFAULTS.step_trace  # a directory: one JSON line per step (diagnosis)
    worker_heartbeat_s: float = Field(DEFAULTS.heartbeat_s, gt=0)
    worker_start_timeout_s: float = Field(600.0, gt=0)
    worker_stop_grace_s: float = Field(5.0, ge=0)

    # -- worker memory (worker/governor.py); 0: 75% of RAM (or of Metal's working set)
    memory_budget_bytes: int = Field(DEFAULTS.memory_budget_bytes, ge=0)
    # -- a sharded worker group on this host (worker/group.py, docs/distributed.md)
    group_size: int = Field(DEFAULTS.group_size, ge=1, le=64)
    group_backend: Literal["ring", "nccl"] = "ring"  # DEFAULTS.group_backend, as a Literal
    kv_budget_bytes: int = Field(DEFAULTS.kv_budget_bytes, ge=0)  # 0: what the budget leaves
    prefix_cache_bytes: int = Field(DEFAULTS.prefix_cache_bytes, ge=0)  # 0: no prefix cache
    # -- grammar compilation in the worker (worker/constraints.py)
    grammar_compile_threads: int = Field(DEFAULTS.grammar_compile_threads, ge=1, le=64)
    grammar_compile_timeout_s: float = Field(DEFAULTS.grammar_compile_timeout_s, gt=0)
    grammar_max_bytes: int = Field(DEFAULTS.grammar_max_bytes, ge=1)

    # -- supervision (gateway/workers/supervisor.py)
    restart_backoff_initial_s: float = Field(0.5, gt=0)
    restart_backoff_max_s: float = Field(30.0, gt=0)
    restart_stable_s: float = Field(60.0, gt=0)
    restart_crash_budget: int = Field(5, ge=1)
    restart_crash_window_s: float = Field(600.0, gt=0)
    replay_limit: int = Field(1, ge=0, le=1)  # of a request that sent no byte (crash_ledger.py)
    # A FAILED model restarts after this, doubled per failure to failed_retry_max_s; 0: never.
    failed_retry_s: float = Field(60.0, ge=0)
    failed_retry_max_s: float = Field(3600.0, gt=0)
    shutdown_grace_s: float = Field(30.0, ge=0)  # in-flight requests finish within this
    # -- health: what /ready calls a live, progressing worker
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    watchdog_s: float = Field(120.0, gt=0)

    # -- request limits
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    default_max_tokens: int = Field(1024, ge=1)
    max_tokens_limit: int = Field(0, ge=0)  # 0: only the context length limits max_tokens
    max_prompt_tokens: int = Field(0, ge=0)  # 0: only the context length limits prompts
    max_stop_strings: int = Field(16, ge=0)
    max_messages: int = Field(10_000, ge=1)  # per request, checked before validation
    # JSON values (keys, items, scalars) of a body of 1 MiB or more, counted off the loop
    max_json_values: int = Field(200_000, ge=1000)
    request_timeout_s: float = Field(600.0, gt=0)
    sse_keepalive_s: float = Field(15.0, ge=0)  # 0: no keep-alive comments
    # A write to a client that cannot complete in this long ends the request
    # (gateway/http/slow_reader.py): the worker aborts it, the connection is cut.
    slow_reader_timeout_s: float = Field(30.0, gt=0)

    # -- slow clients (gateway/http/slow_clients.py)
    header_timeout_s: float = Field(10.0, gt=0)  # headers within this; also the idle keep-alive
    body_timeout_s: float = Field(10.0, gt=0)  # a body's grace before the minimum rate applies
    body_min_bytes_per_s: float = Field(65536.0, gt=0)
    max_connections: int = Field(512, ge=1)  # more are closed at once

    # -- admission (per served model)
    max_in_flight: int = Field(0, ge=0)  # 0: max_batch
    max_queued: int = Field(128, ge=0)
    drain_window_s: float = Field(30.0, gt=0)
    retry_after_min_s: int = Field(1, ge=1)
    retry_after_max_s: int = Field(60, ge=1)

    # -- authentication and per-key rate limits
    api_keys: tuple[APIKey, ...] = ()
    allow_unauthenticated_remote: bool = False
    rate_limit_rpm: float = Field(0.0, ge=0)  # 0: no rate limit unless a key sets its own
    rate_limit_burst: int = Field(0, ge=0)  # 0: ten seconds' worth of requests, at least 1

    # -- the Responses API's stored responses (gateway/api/openai/responses_store.py)
    responses_store_bytes: int = Field(64 * 1024 * 1024, ge=0)  # 0: nothing is stored
    responses_ttl_s: float = Field(3600.0, gt=0)  # a stored response expires this long after

    # -- frontend
    tokenizer_threads: int = Field(2, ge=1, le=64)
    # A request ready while the worker is idle and others still tokenize waits this long at most.
    arrival_window_s: float = Field(0.005, ge=0, le=1.0)

    # -- logging and tracing
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_requests: bool = True
    trace_file: str = ""  # empty: no Chrome trace output

    # -- tests only
    test_faults: bool = False  # POST /models/{model}/fault; the worker reads MLXD_TEST_FAULTS too

    @field_validator("model")
    @classmethod
    def _model_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a model directory or 'default'")
        return v

    @field_validator("chunk_buckets")
    @classmethod
    def _buckets(cls, v: str) -> str:
        parts = [x for x in v.replace(" ", "").split(",") if x]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError("must be a comma-separated list of positive sizes, e.g. '64,256,1024'")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        # "field: message" lets load_settings name the field in its one-line error.
        if 0 < self.pacing_factor <= 1:
            raise ValueError("pacing_factor: must be 0 (the backend's) or above 1")
        if self.retry_after_min_s > self.retry_after_max_s:
            raise ValueError("retry_after_min_s: must not exceed retry_after_max_s")
        if self.models and (self.model != "default" or self.model_name):
            raise ValueError("models: set either model (one model) or models, not both")
        names = [n for m in self.models for n in (m.name, *m.aliases)]
        if len(set(names)) != len(names):
            raise ValueError("models: two models share a name or alias")
        labels = [k.label for k in self.api_keys]
        if len(set(labels)) != len(labels):
            raise ValueError("api_keys: two keys share a name")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @property
    def in_flight_cap(self) -> int:
        return self.max_in_flight or self.max_batch

    def model_entries(self) -> tuple[ModelEntry, ...]:
        """The configured models; without a `models` list, `model` as one pinned entry."""
        if self.models:
            return self.models
        name = self.model_name
        if not name:
            name = DEFAULT_MODEL_NAME if self.model == "default" else Path(self.model).name
        return (ModelEntry(name=name or "model", path=self.model, pinned=True, idle_timeout_s=0),)

    def worker_config(self, *, socket: str, epoch: int) -> WorkerConfig:
        """The launch contract of this model's worker: the one place it is built."""
        # Every setting named as in WorkerConfig (model, max_batch, ...) passes as is.
        same = {f.name for f in dataclasses.fields(WorkerConfig)} & set(type(self).model_fields)
        return WorkerConfig(
            **{name: getattr(self, name) for name in sorted(same)},
            socket=socket,
            model_id=self.model_name,
            epoch=epoch,
            pacing=self.prefill_pacing,
            heartbeat_s=self.worker_heartbeat_s,
        )

    def for_model(self, entry: ModelEntry, memory_budget_bytes: int | None = None) -> Settings:
        """This model's worker settings: the shared ones with its path, name and budget."""
        path = entry.path if entry.path == "default" else str(Path(entry.path).expanduser())
        update: dict[str, Any] = {"model": path, "model_name": entry.name}
        for name in ("group_size", "group_backend"):
            if getattr(entry, name) is not None:
                update[name] = getattr(entry, name)
        if memory_budget_bytes is not None:
            update["memory_budget_bytes"] = memory_budget_bytes
        return self.model_copy(update=update)


class ConfigError(Exception):
    """Invalid configuration: one line naming the field."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def load_settings(
    config_file: str | Path | None = None,
    *,
    cli_api_keys: list[str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build the settings; raises ConfigError with a one-line message.

    `cli_api_keys` (from `--api-key`, each with every scope) are added to the
    keys from the file and the environment rather than replacing them.
    """
    path: Path | None = None
    if config_file is not None:
        path = Path(config_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
    elif DEFAULT_CONFIG_FILE.expanduser().is_file():
        path = DEFAULT_CONFIG_FILE.expanduser()

    class _FromFile(Settings):
        model_config = SettingsConfigDict(
            env_prefix="MLXD_", frozen=True, extra="forbid", toml_file=path
        )

    try:
        values = _FromFile(**{k: v for k, v in overrides.items() if v is not None})
        keys = values.api_keys + tuple(
            APIKey.model_validate({"key": k, "scopes": sorted(ALL_SCOPES), "name": f"cli-{i}"})
            for i, k in enumerate(cli_api_keys or [], 1)
        )
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None
    except ValueError as e:  # a TOML syntax error, an environment value that is not JSON
        m = re.search(r'field "(\w+)" from source "(\w+)"', str(e))
        if m:
            where = "the environment" if m[2].startswith("Env") else m[2]
            raise ConfigError(
                f"invalid setting {m[1]!r}: cannot parse its value from {where} (expected JSON)"
            ) from None
        if isinstance(e, tomllib.TOMLDecodeError):
            raise ConfigError(f"invalid config file {path}: {e}".splitlines()[0]) from None
        raise ConfigError(f"invalid configuration: {e}".splitlines()[0]) from None
    fields = {name: getattr(values, name) for name in Settings.model_fields}
    fields["api_keys"] = keys
    settings = Settings.model_construct(**fields)
    if len({k.label for k in keys}) != len(keys):
        raise ConfigError("invalid setting 'api_keys': two keys share a name")
    if not keys and not settings.allow_unauthenticated_remote and not is_loopback(settings.host):
        raise ConfigError(
            f"invalid setting 'host': {settings.host!r} is not a loopback address and no "
            "api_keys are configured; add a key or set allow_unauthenticated_remote"
        )
    return settings


def _one_line(e: ValidationError) -> str:
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not field:
        head, sep, rest = msg.partition(": ")
        if sep and head in Settings.model_fields:
            field, msg = head, rest
    return f"invalid setting {field or 'config'!r}: {msg}".splitlines()[0]
