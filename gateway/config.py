"""The gateway's one frozen settings object.

Sources, lowest to highest precedence: field defaults, a TOML file
(`--config`, else `~/.config/mlxd/mlxd.toml` when it exists), `MLXD_*`
environment variables, then CLI flags. Nothing is read at import time:
`load_settings()` is called once by the CLI (or a test) and the result is
passed down explicitly. docs/configuration.md documents every field; a test
keeps the two in step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_CONFIG_FILE = Path("~/.config/mlxd/mlxd.toml")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MLXD_", frozen=True, extra="forbid")

    # -- listening
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # -- the model
    model: str = Field("default", description="model directory, or 'default' (embedded)")
    model_name: str = ""  # served id; empty: the directory's name
    cache_dir: str = ""  # where the embedded default model is converted; empty: ~/.cache/mlxd

    # -- worker engine
    max_batch: int = Field(32, ge=1, le=1024)
    prefill_batch: int = Field(8, ge=1, le=256)
    prefill_chunk: int = Field(2048, ge=16)
    prefill_pacing: bool = True
    worker_heartbeat_s: float = Field(0.5, gt=0)
    worker_start_timeout_s: float = Field(600.0, gt=0)
    worker_stop_grace_s: float = Field(5.0, ge=0)

    # -- request limits
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    default_max_tokens: int = Field(1024, ge=1)
    max_tokens_limit: int = Field(0, ge=0)  # 0: only the context length limits max_tokens
    max_prompt_tokens: int = Field(0, ge=0)  # 0: only the context length limits prompts
    max_stop_strings: int = Field(16, ge=0)
    request_timeout_s: float = Field(600.0, gt=0)

    # -- frontend
    tokenizer_threads: int = Field(2, ge=1, le=64)

    # -- logging
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("model")
    @classmethod
    def _model_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a model directory or 'default'")
        return v

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


class ConfigError(Exception):
    """Invalid configuration: one line naming the field."""


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the settings; raises ConfigError with a one-line message."""
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
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "config"
        raise ConfigError(f"invalid setting {field!r}: {err['msg']}") from None
    return Settings.model_construct(**values.model_dump())
