"""Response bodies of the operational routes (gateway/http/operations.py), as pydantic models.

The handlers build their JSON from these classes and gateway/http/openapi.py
describes the responses from the same classes. Fields that are sometimes absent
default to None and are left out of the JSON when not set
(gateway/api/openai/schemas.dump).

Threading: pure data, any thread.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Live(BaseModel):
    status: Literal["ok"]


class Startup(BaseModel):
    status: Literal["started", "starting", "failed"]
    startup_s: float | None = None
    model: str | None = None
    phase: str | None = None
    reason: str | None = None
    retry_in_s: float | None = Field(
        default=None,
        description="failed: seconds until the next start attempt (null: none scheduled)",
    )


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    model: str | None
    phase: str | None = None
    reason: str | None = None


class ServedModel(BaseModel):
    id: str
    aliases: list[str]
    pinned: bool
    state: str
    phase: str
    ready: bool
    reason: str


class ServedModels(BaseModel):
    object: Literal["list"]
    data: list[ServedModel]


class ModelsMemory(BaseModel):
    budget: int
    used: int


class Rank(BaseModel):
    rank: int
    pid: int
    alive: bool


class QueueStatus(BaseModel):
    queued: int
    in_flight: int
    max_queued: int
    max_in_flight: int
    drain_rate_per_s: float
    retry_after_s: int


class ModelStatus(BaseModel):
    model: str
    aliases: list[str]
    pinned: bool
    state: Literal["stopped", "starting", "ready", "draining", "restarting", "failed", "stopping"]
    phase: str
    ready: bool
    reason: str
    startup_s: float | None
    restarts: int
    retry_in_s: float | None = Field(
        description="FAILED: seconds until the next start attempt (null: none scheduled)"
    )
    poisoned_requests: int = Field(
        description="Requests dropped for crashing the worker twice (docs/reliability.md)"
    )
    starts: int
    leases: int
    idle_timeout_s: float
    idle_s: float
    footprint_bytes: int
    models_memory: ModelsMemory
    identity: str | None
    path: str | None
    backend: str | None
    blas: str | None
    context_length: int | None
    load_time_s: float | None
    warmup_s: float | None
    worker_pid: int | None
    epoch: int | None
    ranks: list[Rank] = Field(description="A sharded group: every rank's process")
    queue: QueueStatus
    in_flight: int
    memory: dict[str, Any]
    prefix_cache: dict[str, Any]
    worker: dict[str, Any] | None = Field(
        description="The worker's own stats (requests, batch_rows, governor, ...)"
    )
    worker_error: str | None


class Version(BaseModel):
    version: str | None
    protocol_version: int
    python: str
    mlx: str | None
    mlx_lm: str | None
    model_identity: str | None
    models: dict[str, str | None]


class FaultRequest(BaseModel):
    kind: Literal["wedge", "crash", "corrupt", "step_no_memory"]
    seconds: float | None = None
    steps: int | None = Field(default=None, ge=1, le=1_000_000)


class FaultAccepted(BaseModel):
    status: Literal["accepted"]
    kind: str
