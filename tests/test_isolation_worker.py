"""Isolation, worker side (issue 13, findings 1, 4, 5, 8): a hostile request gets its own error.

Each test sends one attack from the issue through the real gateway and worker with
the official `openai` SDK while another user's stream runs, and asserts the
attack's status, that the neighbour's stream completed normally, and that the
worker was never restarted (same pid, same restart count). The rows of the attack
table in docs/reliability.md ("Isolation, worker side") point here; the gateway side is
tests/test_isolation.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from tests.helpers import NO_EOS, Server

CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def _objects(n: int) -> dict[str, Any]:
    """An anyOf of n one-key objects: a grammar whose size grows with n."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {f"key{i}": {"type": "integer"}},
                "required": [f"key{i}"],
                "additionalProperties": False,
            }
            for i in range(n)
        ]
    }


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def _neighbour(client: openai.OpenAI, started: threading.Event) -> str | None:
    """Another user's stream: greedy, EOS banned, so it runs to its length."""
    stream = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7, 8],
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"logit_bias": NO_EOS},
    )
    finish = None
    for chunk in stream:
        started.set()
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
    return finish


@contextmanager
def _unharmed_neighbour(server: Server, client: openai.OpenAI) -> Iterator[None]:
    """Run the body while a neighbour streams; assert it finished and the worker stayed."""
    before = server.status()
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        neighbour = pool.submit(_neighbour, client, started)
        assert started.wait(60), "the neighbour's stream did not start"
        yield
        assert neighbour.result(timeout=120) == "length"
    after = server.status()
    assert after["worker_pid"] == before["worker_pid"], "the worker was replaced"
    assert after["restarts"] == before["restarts"]


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        extra_body=extra,
    )


ATTACKS: dict[str, tuple[Callable[[openai.OpenAI], Any], str]] = {
    "logit_bias key of 5,001 digits": (
        lambda c: _chat(c, logit_bias={"9" * 5001: 1}),
        "logit_bias",
    ),
    "logit_bias key superscript two (U+00B2)": (
        lambda c: _chat(c, logit_bias={"\u00b2": 1}),
        "logit_bias",
    ),
    "logit_bias key arabic-indic one (U+0661)": (
        lambda c: _chat(c, logit_bias={"\u0661": 1}),
        "logit_bias",
    ),
    "chat_template_kwargs return_tensors": (
        lambda c: _chat(c, chat_template_kwargs={"return_tensors": "np"}),
        "return_tensors",
    ),
    "chat_template_kwargs tokenize": (
        lambda c: _chat(c, chat_template_kwargs={"tokenize": False}),
        "tokenize",
    ),
    "json schema with a $ref cycle": (
        lambda c: _chat(c, response_format=_schema(CYCLE)),
        "cannot be generated",
    ),
    "json schema anyOf of 5,000 objects": (
        lambda c: _chat(c, response_format=_schema(_objects(5000))),
        "cannot be generated",
    ),
}


@pytest.mark.parametrize("attack", ATTACKS.values(), ids=ATTACKS.keys())
def test_attack_is_a_400_and_the_neighbour_never_notices(
    server: Server, client: openai.OpenAI, attack: tuple[Callable[[openai.OpenAI], Any], str]
) -> None:
    send, needle = attack
    with _unharmed_neighbour(server, client), pytest.raises(openai.BadRequestError) as err:
        send(client)
    assert needle in str(err.value)
    assert "Traceback" not in str(err.value)


def test_four_large_grammars_compile_while_the_neighbour_streams(
    server: Server, client: openai.OpenAI
) -> None:
    """Finding 8: grammars compile off the engine thread; all four are served."""
    schemas = [_objects(600 + 100 * i) for i in range(4)]  # distinct: no cache helps
    with _unharmed_neighbour(server, client), ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda s: _chat(client, response_format=_schema(s)), schemas))
    for a in answers:
        assert a.choices[0].finish_reason in ("length", "stop")
    assert server.worker_stats()["compiling"] == 0
