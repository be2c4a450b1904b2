"""Streaming detokenization with stop strings (gateway/serving/tokenizer.TextStream).

The tiny random model's real tokenizer; tokens are fed one at a time, as a
worker's steps would deliver them, so a stop string always spans several tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.serving.tokenizer import Frontend

TEXT = "The answer is STOP and more"


@pytest.fixture(scope="module")
def frontend(tiny_model_dir: Path) -> Iterator[Frontend]:
    f = Frontend(str(tiny_model_dir), eos_token_ids=[2], threads=1)
    yield f
    f.close()


def _feed(frontend: Frontend, text: str, stops: list[str]) -> tuple[list[str], bool, str | None]:
    stream = frontend.text_stream(stops)
    ids = frontend._encode(text)
    out = []
    for i, t in enumerate(ids):
        delta = stream.add([t], final=i == len(ids) - 1)
        out.append(delta.text)
        if delta.stopped:
            break
    return out, stream.stopped, stream.matched


def test_without_stops_every_token_text_goes_out_at_once(frontend: Frontend) -> None:
    out, stopped, _ = _feed(frontend, TEXT, [])
    assert "".join(out) == TEXT and not stopped


def test_text_ends_before_the_stop_string(frontend: Frontend) -> None:
    out, stopped, matched = _feed(frontend, TEXT, ["STOP"])
    assert stopped and matched == "STOP"
    assert "".join(out) == "The answer is "


def test_a_possible_stop_prefix_is_held_back_never_sent(frontend: Frontend) -> None:
    # "ST" may begin "STOP": nothing of it may reach the client before it is known.
    out, _, _ = _feed(frontend, TEXT, ["STOP"])
    sent = ""
    for piece in out:
        sent += piece
        assert "S" not in sent, out  # the only S in TEXT starts the stop string


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop(frontend: Frontend) -> None:
    out, stopped, _ = _feed(frontend, TEXT, ["STOPPED"])
    assert not stopped
    assert "".join(out) == TEXT  # "STOP" was held, then released by " and"


def test_the_earliest_of_several_stops_wins(frontend: Frontend) -> None:
    out, stopped, matched = _feed(frontend, TEXT, ["more", "answer"])
    assert stopped and matched == "answer"
    assert "".join(out) == "The "
