"""The JSON helper's verdicts (gateway/serving/json_inspect.py), without processes;
the helper itself is exercised end to end by tests/test_isolation.py."""

from __future__ import annotations


def test_the_json_helper_counts_values_and_refuses_bad_bodies() -> None:
    # gateway/serving/json_inspect.py: what the helper process runs, called directly.
    from gateway.serving.json_inspect import inspect

    # 3 containers, 2 keys, 3 scalars
    assert inspect(b'{"a": [1, 2, {"b": "c"}]}', 100) == ("ok", "8")
    assert inspect(b'{"a": [1, 2', 100)[0] == "invalid"
    assert inspect(b"\xff", 100)[0] == "invalid"
    assert inspect(b"[" * 100_000 + b"]" * 100_000, 10**9)[0] == "deep"
    assert inspect(b"[" + b"1," * 5000 + b"1]", 1000)[0] == "too_many"
