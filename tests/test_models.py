"""Several models in one gateway (gateway/workers/registry.py): lazy start, idle stop, one budget.

Real servers with a TOML config listing two tiny random models, each served by
its own worker process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import ConfigError, load_settings
from tests.helpers import NO_EOS, Server, greedy_body, start_server, stop_server, wait_for

MB = 1 << 20


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.modelfiles.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("models") / "tiny-b", seed=1)


def _serve(tmp: Path, config: str, **env: str) -> Server:
    path = tmp / "mlxd.toml"
    path.write_text(config)
    return start_server(
        None,
        tmp / "server.log",
        env={"MLXD_RESTART_BACKOFF_INITIAL_S": "0.1", **env},
        extra_args=["--config", str(path)],
    )


def status(srv: Server, model: str) -> dict:
    r = httpx.get(f"{srv.url}/models/{model}/status", timeout=10)
    r.raise_for_status()
    return r.json()


def wait_for_state(srv: Server, model: str, state: str, timeout_s: float = 60) -> dict:
    """Poll the model's status until it is in `state`; that status."""
    seen: list[dict] = []

    def reached() -> bool:
        seen.append(status(srv, model))
        return seen[-1]["state"] == state

    wait_for(reached, timeout_s, f"{model} to become {state}")
    return seen[-1]


def complete(srv: Server, model: str, n: int = 4, prompt: list[int] | None = None) -> dict:
    return srv.complete(prompt or [5, 6, 7], n, model=model)


# -- a pinned model and a lazy one ---------------------------------------------------


@pytest.fixture(scope="module")
def lazy_server(
    tiny_model_dir: Path, second_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    config = f"""
[[models]]
name = "a"
path = "{tiny_model_dir}"
pinned = true

[[models]]
name = "b"
path = "{second_model_dir}"
aliases = ["b-latest"]
idle_timeout_s = 1.5
memory_bytes = {300 * MB}
sampling = {{ temperature = 0.0, max_tokens = 5 }}

[[models]]
name = "broken"
path = "/nonexistent/model"
idle_timeout_s = 1.0
memory_bytes = {100 * MB}
"""
    srv = _serve(tmp_path_factory.mktemp("lazy"), config, MLXD_SSE_KEEPALIVE_S="0.2")
    yield srv
    stop_server(srv)


def test_only_the_pinned_model_starts_with_the_gateway(lazy_server: Server) -> None:
    models = httpx.get(lazy_server.url + "/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert by_id["a"]["ready"] and by_id["a"]["pinned"]
    assert by_id["b"]["state"] == "stopped" and not by_id["b"]["pinned"]
    # /ready speaks for the pinned models: a stopped lazy model is not a failure
    assert httpx.get(lazy_server.url + "/ready", timeout=10).status_code == 200
    assert httpx.get(lazy_server.url + "/models/b/ready", timeout=10).status_code == 503


def test_v1_models_lists_every_configured_model(lazy_server: Server) -> None:
    client = openai.OpenAI(base_url=lazy_server.v1, api_key="none")
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"a", "b", "broken"}
    assert client.models.retrieve("b-latest").id == "b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("c")


def test_lazy_model_starts_on_demand_serves_and_stops_when_idle(
    lazy_server: Server, second_model_dir: Path
) -> None:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    client = openai.OpenAI(base_url=lazy_server.v1, api_key="none")
    r = client.completions.create(
        model="b-latest",  # an alias
        prompt="hello there",
        max_tokens=6,
        temperature=0,
        extra_body={"logit_bias": NO_EOS, "return_token_ids": True},
    )
    assert r.model == "b-latest" and r.usage.completion_tokens == 6
    # served by b's own weights: equal to mlx-lm on b's directory
    model, tok = load(str(second_model_dir))
    bias = make_logits_processors(logit_bias={0: -100.0, 1: -100.0, 2: -100.0})
    prompt_ids = tok.encode("hello there")
    expected = [
        int(x.token)
        for x in stream_generate(
            model,
            tok,
            prompt_ids,
            max_tokens=6,
            sampler=make_sampler(temp=0.0),
            logits_processors=bias,
        )
    ]
    assert r.choices[0].model_extra["token_ids"] == expected
    st = status(lazy_server, "b")
    assert st["state"] == "ready" and st["starts"] >= 1 and st["worker_pid"]
    pid_a = status(lazy_server, "a")["worker_pid"]
    assert st["worker_pid"] != pid_a  # its own worker process
    stopped = wait_for_state(lazy_server, "b", "stopped")
    assert "idle" in stopped["reason"]
    assert status(lazy_server, "a")["state"] == "ready"
    assert httpx.get(lazy_server.url + "/ready", timeout=10).status_code == 200
    metrics = httpx.get(lazy_server.url + "/metrics", timeout=10).text
    assert 'mlxd_model_running{model="b"} 0.0' in metrics
    assert 'mlxd_model_running{model="a"} 1.0' in metrics


def test_a_stream_gets_keepalives_while_its_model_starts(lazy_server: Server) -> None:
    wait_for_state(lazy_server, "b", "stopped")
    lines: list[str] = []
    with httpx.stream(
        "POST",
        lazy_server.v1 + "/completions",
        json={
            "model": "b",
            "prompt": [4, 5],
            "max_tokens": 3,
            "temperature": 0,
            "logit_bias": NO_EOS,
            "stream": True,
        },
        timeout=120,
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    first_data = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
    assert any(ln.startswith(": keep-alive") for ln in lines[:first_data]), lines[:5]
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert lines[-1] == "data: [DONE]"


def test_model_sampling_profile_fills_what_the_request_leaves_out(lazy_server: Server) -> None:
    # b's profile: temperature 0, max_tokens 5
    r = httpx.post(
        lazy_server.v1 + "/completions",
        json={"model": "b", "prompt": [9, 8, 7], "logit_bias": NO_EOS, "return_token_ids": True},
        timeout=120,
    ).json()
    assert r["usage"]["completion_tokens"] == 5
    explicit = complete(lazy_server, "b", 5, prompt=[9, 8, 7])
    assert r["choices"][0]["token_ids"] == explicit["choices"][0]["token_ids"]
    # a request's own value wins over the profile
    assert complete(lazy_server, "b", 2, prompt=[9, 8, 7])["usage"]["completion_tokens"] == 2


def test_a_model_that_cannot_load_answers_503_then_retries_after_idling(
    lazy_server: Server,
) -> None:
    def ask() -> httpx.Response:
        return httpx.post(
            lazy_server.v1 + "/completions",
            json={"model": "broken", "prompt": "x", "max_tokens": 1},
            timeout=120,
        )

    r = ask()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_not_ready"
    st = status(lazy_server, "broken")
    assert st["state"] == "failed" and st["starts"] == 1, st
    assert httpx.get(lazy_server.url + "/ready", timeout=10).status_code == 200  # not pinned
    assert "idle" in wait_for_state(lazy_server, "broken", "stopped")["reason"]
    assert ask().status_code == 503
    assert status(lazy_server, "broken")["starts"] == 2  # tried again, not stuck


def test_unknown_model_is_404_without_starting_anything(lazy_server: Server) -> None:
    r = httpx.post(
        lazy_server.v1 + "/completions",
        json={"model": "nope", "prompt": "x", "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- a memory budget that fits one of two models ----------------------------------------


@pytest.fixture(scope="module")
def budget_server(
    tiny_model_dir: Path, second_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    config = f"""
models_memory_budget_bytes = {500 * MB}

[[models]]
name = "a"
path = "{tiny_model_dir}"
memory_bytes = {300 * MB}

[[models]]
name = "b"
path = "{second_model_dir}"
memory_bytes = {300 * MB}

[[models]]
name = "c"  # small enough to fit beside either
path = "{tiny_model_dir}"
memory_bytes = {100 * MB}
"""
    srv = _serve(tmp_path_factory.mktemp("budget"), config)
    yield srv
    stop_server(srv)


def test_budget_stops_the_idle_model_before_the_other_starts(budget_server: Server) -> None:
    assert status(budget_server, "a")["state"] == "stopped"  # nothing pinned
    complete(budget_server, "a")
    assert status(budget_server, "a")["state"] == "ready"
    complete(budget_server, "b")
    a, b = status(budget_server, "a"), status(budget_server, "b")
    assert b["state"] == "ready"
    assert a["state"] == "stopped" and "make room for b" in a["reason"]
    assert b["models_memory"] == {"budget": 500 * MB, "used": 300 * MB}


def test_a_request_in_flight_blocks_eviction(budget_server: Server) -> None:
    complete(budget_server, "b")  # b runs, a is stopped
    assert status(budget_server, "a")["state"] == "stopped"
    got: list[int] = []
    a_result: dict = {}
    with httpx.stream(
        "POST",
        budget_server.v1 + "/completions",
        json=greedy_body("b", [1, 2, 3], 3000, stream=True),
        timeout=120,
    ) as stream:
        lines = stream.iter_lines()

        def read(n: int) -> None:
            for line in lines:
                if line.startswith("data: {"):
                    got.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                if len(got) >= n:
                    return

        read(4)

        def ask_a() -> None:
            a_result["body"] = complete(budget_server, "a")

        t = threading.Thread(target=ask_a)
        t.start()
        # a's request waits, holding a's lease, while b's stream holds b
        deadline = time.monotonic() + 30
        while status(budget_server, "a")["leases"] != 1:
            assert time.monotonic() < deadline, "a's request never arrived"
            time.sleep(0.05)
        assert status(budget_server, "a")["state"] == "stopped"
        read(len(got) + 20)  # b keeps streaming: it was not stopped under it
        # a model that fits starts and serves while a's request waits for room
        assert complete(budget_server, "c")["usage"]["completion_tokens"] == 4
        assert status(budget_server, "a")["leases"] == 1
        assert status(budget_server, "b")["state"] == "ready"
        assert "body" not in a_result
    # b's stream ended (the client closed it): its lease is gone, so a starts
    t.join(120)
    assert a_result["body"]["usage"]["completion_tokens"] == 4
    assert status(budget_server, "b")["state"] == "stopped"
    assert status(budget_server, "a")["state"] == "ready"


# -- configuration -----------------------------------------------------------------


def test_config_rejects_duplicate_names_and_mixed_forms(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[[models]]\nname = "a"\npath = "x"\n[[models]]\nname = "b"\npath = "y"\naliases = ["a"]\n'
    )
    with pytest.raises(ConfigError, match="share a name"):
        load_settings(cfg)
    cfg.write_text('model = "/some/dir"\n[[models]]\nname = "a"\npath = "x"\n')
    with pytest.raises(ConfigError, match="not both"):
        load_settings(cfg)
    cfg.write_text('[[models]]\nname = "a"\npath = "x"\nidle_timeout_s = -1\n')
    with pytest.raises(ConfigError, match="idle_timeout_s"):
        load_settings(cfg)
    # a model entry may ask for its own worker group; the others keep the server's
    cfg.write_text(
        'group_size = 1\n[[models]]\nname = "a"\npath = "x"\ngroup_size = 2\n'
        '[[models]]\nname = "b"\npath = "y"\n'
    )
    settings = load_settings(cfg)
    a, b = settings.models
    assert settings.for_model(a).group_size == 2 and settings.for_model(b).group_size == 1
