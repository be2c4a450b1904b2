"""The model registry's own logic (gateway/workers/registry.py): names, footprints, room.

No worker starts here: these are the lookups and the memory arithmetic that decide
which model serves a request and which idle models stop to make room for it.
tests/test_models.py covers the same registry end to end with real workers.
"""

from __future__ import annotations

import pytest

from gateway.config import ModelEntry, Settings
from gateway.http.errors import APIError
from gateway.workers.registry import GIB, HostedModel, ModelRegistry, estimate_footprint


def _registry(*entries: ModelEntry, budget: int = 10 * GIB) -> ModelRegistry:
    return ModelRegistry(Settings(models=entries, models_memory_budget_bytes=budget))


def _entry(name: str, gib: int, **kw: object) -> ModelEntry:
    return ModelEntry(name=name, path=f"/nonexistent/{name}", memory_bytes=gib * GIB, **kw)


class _Running:
    """Marks a hosted as running for the registry's arithmetic (no worker is started)."""


def _run(hosted: HostedModel, last_used: float) -> None:
    hosted.served = _Running()  # type: ignore[assignment]
    hosted.last_used = last_used


def test_names_and_aliases_resolve_to_one_slot() -> None:
    reg = _registry(_entry("a", 1, aliases=("alpha", "first"), pinned=True), _entry("b", 1))
    a = reg.resolve("a")
    assert reg.resolve("alpha") is a and reg.resolve("first") is a
    assert reg.resolve("b") is not a
    assert reg.primary is a and reg.pinned == [a]
    assert reg.get("nope") is None
    with pytest.raises(APIError) as e:
        reg.resolve("nope")
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")


def test_footprint_is_configured_or_estimated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert estimate_footprint(_entry("a", 3)) == 3 * GIB
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    estimated = estimate_footprint(ModelEntry(name="x", path=str(tmp_path)))
    assert estimated == int(1000 * 1.1) + GIB  # weights x 1.1, plus 1 GiB for KV


def test_room_is_made_by_stopping_idle_models_least_recently_used_first() -> None:
    reg = _registry(_entry("a", 4), _entry("b", 4), _entry("c", 4), _entry("d", 4), budget=12 * GIB)
    a, b, c, d = reg.hosted_models
    _run(a, last_used=30.0)
    _run(b, last_used=10.0)  # the least recently used
    _run(c, last_used=20.0)
    assert reg.used_bytes() == 12 * GIB
    assert reg._room_for(d) == [b]


def test_busy_and_pinned_models_are_never_stopped_for_room() -> None:
    reg = _registry(
        _entry("p", 4, pinned=True), _entry("busy", 4), _entry("new", 4), budget=8 * GIB
    )
    p, busy, new = reg.hosted_models
    _run(p, last_used=0.0)
    _run(busy, last_used=0.0)
    busy.leases = 1  # a request holds it
    assert reg._room_for(new) is None  # wait: nothing may be stopped
    busy.leases = 0
    assert reg._room_for(new) == [busy]


def test_a_model_that_fits_stops_nothing() -> None:
    reg = _registry(_entry("a", 2), _entry("b", 2), budget=8 * GIB)
    _run(reg.hosted_models[0], last_used=0.0)
    assert reg._room_for(reg.hosted_models[1]) == []


def test_a_failed_tokenizer_preload_is_a_logged_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The preload beside the worker's start must not leave an unretrieved task
    exception; the Frontend's own load reports the real error later."""
    import asyncio

    from gateway.workers.served_model import _preload_done

    def broken() -> None:
        raise ImportError("no tokenizer stack")

    async def run() -> None:
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(broken))
        task.add_done_callback(_preload_done)
        await asyncio.wait([task])

    with caplog.at_level("WARNING", logger="mlxd.gateway.model"):
        asyncio.run(run())
    assert "tokenizer preload failed: no tokenizer stack" in caplog.text


@pytest.mark.parametrize("same", [True, False])
def test_the_early_tokenizer_is_kept_only_for_what_the_worker_reports(
    tiny_model_dir, same: bool
) -> None:  # type: ignore[no-untyped-def]
    """Built beside the worker's start from the configured directory; a worker that
    reports other EOS ids gets a frontend loaded for what it reported instead."""
    import asyncio

    from gateway.serving.tokenizer import Frontend
    from gateway.workers.served_model import ServedModel

    async def run() -> Frontend | None:
        served = ServedModel(Settings(model=str(tiny_model_dir)))
        early = asyncio.to_thread(Frontend, str(tiny_model_dir), None, 1)
        served._early = asyncio.get_running_loop().create_task(early)
        eos = sorted((await served._early).eos_token_ids)
        return await served._early_frontend(str(tiny_model_dir), eos if same else [9999])

    frontend = asyncio.run(run())
    assert (frontend is not None) == same
    if frontend is not None:
        frontend.close()
