"""Shared fixtures: a tiny random model, and real `mlxd serve` processes.

The helpers they use (Server, start_server, ...) live in tests/helpers.py, which is
what test modules import.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import TOOLS_KEY, Server, start_server, stop_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.modelfiles.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("logs") / "server.log"
    srv = start_server(str(tiny_model_dir), log_path, model_name="tiny")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def tiny_tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.modelfiles.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("models") / "tiny-tools", seed=0, tools=True)


@pytest.fixture(scope="session")
def tools_server(
    tiny_tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("logs") / "tools-server.log"
    srv = start_server(
        str(tiny_tools_model_dir), log_path, model_name="tools", extra_args=["--api-key", TOOLS_KEY]
    )
    yield srv
    stop_server(srv)
