"""Security: the worker socket against another Unix user, scopes on every route, no secrets in logs.

- A second Unix user can neither reach the worker's socket (its directory is
  0700) nor, if the socket were reachable, use it: the worker checks the
  peer's uid on accept and closes the connection without a Ready.
- With API keys configured, every route in the OpenAPI description enforces
  the scope the description lists (open routes need no key).
- API keys are compared in constant time, against every key.
- Neither keys nor prompt text reach the logs (prompt logging does not exist).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import load_settings
from gateway.http.auth import Authenticator, required_scope
from gateway.http.openapi import build_spec
from protocol.frames import PROTOCOL_VERSION
from protocol.messages import Hello, encode_message
from tests.helpers import Server, start_server, stop_server
from tests.worker_helpers import TOKEN, WorkerProc, spawn_worker

OTHER_USER = "mlxd-sec-test"

# Runs as the other user, with only the standard library: connect to the
# socket, send a valid Hello (the real token, even), report what happened.
_CLIENT = r"""
import json, socket, sys
path, hello = sys.argv[1], bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
try:
    s.connect(path)
except OSError as e:
    print(json.dumps({"connect": e.errno}))
    sys.exit(0)
try:
    s.sendall(hello)
    got = s.recv(65536)
    print(json.dumps({"connect": 0, "reply": got.hex()}))
except OSError as e:
    print(json.dumps({"connect": 0, "error": e.errno}))
"""


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd]:
    """A second, unprivileged Unix user (created for the test when running as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a second Unix user and run a process as it")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not available")
    created = False
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
            check=True,
            capture_output=True,
        )
        created = True
    yield pwd.getpwnam(OTHER_USER)
    if created:
        subprocess.run(["userdel", OTHER_USER], check=False, capture_output=True)


def _system_python() -> str:
    """A Python the other user can run (the venv's may live in root's home)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.access(candidate, os.X_OK) and os.stat(candidate).st_mode & stat.S_IXOTH:
            return candidate
    pytest.skip("no system python3 that another user can run")


def _as_user(user: pwd.struct_passwd, socket_path: str) -> dict:
    hello = encode_message(Hello(PROTOCOL_VERSION, 1, TOKEN)).hex()
    r = subprocess.run(
        [_system_python(), "-I", "-c", _CLIENT, socket_path, hello],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    result: dict = json.loads(r.stdout)
    return result


@pytest.fixture
def private_worker(tiny_model_dir: Path) -> Iterator[WorkerProc]:
    """A worker whose socket lives as in production: a 0700 directory, socket 0600.

    Its parent directory is world-traversable (unlike pytest's tmp_path, which
    would stop the other user one level up and prove nothing).
    """
    base = Path(tempfile.mkdtemp(prefix="mlxd-sec-"))
    base.chmod(0o755)
    w = spawn_worker(tiny_model_dir, base)
    try:
        with contextlib.closing(w.connect()):
            pass  # the socket exists now: the worker listens (and refuses this Hello-less peer)
        yield w
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_other_user_cannot_reach_the_socket_directory(
    private_worker: WorkerProc, other_user: pwd.struct_passwd
) -> None:
    sock_dir = Path(private_worker.socket_path).parent
    assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(private_worker.socket_path).st_mode) == 0o600
    result = _as_user(other_user, private_worker.socket_path)
    assert result == {"connect": 13}, result  # EACCES: cannot even look up the socket
    # The service user still gets in.
    sock, ready = private_worker.handshake()
    assert ready.pid == private_worker.proc.pid
    sock.close()


def test_worker_refuses_a_peer_of_another_uid(
    private_worker: WorkerProc, other_user: pwd.struct_passwd
) -> None:
    # Suppose the permissions were wrong: the directory open, the socket writable.
    sock_dir = Path(private_worker.socket_path).parent
    sock_dir.chmod(0o755)
    os.chmod(private_worker.socket_path, 0o666)
    result = _as_user(other_user, private_worker.socket_path)
    # It connects, sends a valid Hello with the right token, and is closed on
    # without a Ready: the worker checked its uid on accept.
    assert result["connect"] == 0, result
    assert result.get("reply", "") == "" or result.get("error") is not None, result
    assert f"refused a connection from uid {other_user.pw_uid}" in private_worker.log.read_text()
    # The worker keeps its model and still serves its own user.
    sock, ready = private_worker.handshake()
    assert ready.pid == private_worker.proc.pid
    sock.close()


# -- API keys: every route, constant time ---------------------------------------------

INFERENCE = "sk-sec-inference-0123456789"
ADMIN = "sk-sec-admin-0123456789"
MARKER = "zebra-quartz-prompt-marker-7391"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = [
        {"key": INFERENCE, "scopes": ["inference"], "name": "app"},
        {"key": ADMIN, "scopes": ["admin"], "name": "ops"},
    ]
    srv = start_server(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("sec") / "server.log",
        model_name="tiny",
        env={"MLXD_API_KEYS": json.dumps(keys), "MLXD_TEST_FAULTS": "true"},
    )
    yield srv
    stop_server(srv)


def _request(
    srv: Server, method: str, path: str, key: str | None, header: str = "bearer"
) -> httpx.Response:
    headers = {}
    if key:
        headers = {"Authorization": f"Bearer {key}"} if header == "bearer" else {"x-api-key": key}
    body = None
    if method == "post":
        # A body that passes auth and then fails validation: no generation, no fault.
        body = {"model": "tiny", "messages": [], "prompt": [], "kind": "none"}
    return httpx.request(
        method.upper(),
        srv.url + path.replace("{model}", "tiny"),
        json=body,
        headers=headers,
        timeout=30,
    )


def _operations() -> list[tuple[str, str, str | None]]:
    spec = build_spec(test_faults=True)
    ops = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            scopes = [s for req in op["security"] for s in req.get("bearer", [])]
            ops.append((method, path, scopes[0] if scopes else None))
    return ops


@pytest.mark.parametrize(
    ("method", "path", "scope"), _operations(), ids=[f"{m} {p}" for m, p, _ in _operations()]
)
def test_every_route_enforces_its_documented_scope(
    keyed: Server, method: str, path: str, scope: str | None
) -> None:
    assert required_scope(path.replace("{model}", "tiny")) == scope
    none = _request(keyed, method, path, None)
    if scope is None:
        assert none.status_code not in (401, 403), none.text
        return
    anthropic = path.startswith("/v1/messages")  # Anthropic's error shape: a type, no code
    assert none.status_code == 401, none.text
    err = none.json()["error"]
    assert err["type"] == "authentication_error" if anthropic else err["code"] == "missing_api_key"
    assert none.headers["WWW-Authenticate"] == "Bearer"
    wrong = _request(keyed, method, path, ADMIN if scope == "inference" else INFERENCE)
    assert wrong.status_code == 403, wrong.text
    err = wrong.json()["error"]
    assert err["type"] == "permission_error" if anthropic else err["code"] == "insufficient_scope"
    right_key = INFERENCE if scope == "inference" else ADMIN
    for header in ("bearer", "x-api-key"):
        right = _request(keyed, method, path, right_key, header)
        assert right.status_code not in (401, 403), right.text
    wrong = _request(keyed, method, path, right_key + "x", "x-api-key")
    assert wrong.status_code == 401, wrong.text


def test_unknown_routes_need_a_key_too(keyed: Server) -> None:
    # No route enumeration without a key: an unknown path is an inference route.
    r = httpx.get(keyed.url + "/v1/nope", timeout=10)
    assert r.status_code == 401
    r = httpx.get(keyed.url + "/v1/nope", headers={"Authorization": f"Bearer {INFERENCE}"})
    assert r.status_code == 404


def test_openapi_json_is_open_and_describes_the_running_routes(keyed: Server) -> None:
    r = httpx.get(keyed.url + "/openapi.json", timeout=10)
    assert r.status_code == 200
    assert r.json() == json.loads(json.dumps(build_spec(test_faults=True)))


def test_keys_are_compared_in_constant_time_against_every_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = [f"sk-constant-time-{i:04d}" for i in range(5)]
    auth = Authenticator(load_settings(cli_api_keys=keys))
    calls: list[tuple[bytes, bytes]] = []
    import hmac

    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("gateway.http.auth.hmac.compare_digest", counting)
    for presented in (keys[0], keys[-1], "sk-not-a-key-at-all", keys[2][:-1]):
        calls.clear()
        entry = auth.identify(presented)
        assert (entry is not None) == (presented in keys)
        # Every configured key is compared, whichever matched; always as
        # fixed-length digests, never the raw (variable-length) strings.
        assert len(calls) == len(keys)
        assert all(len(a) == len(b) == hashlib.sha256().digest_size for a, b in calls)


def test_no_key_or_prompt_text_in_the_logs(keyed: Server) -> None:
    inference = {"Authorization": f"Bearer {INFERENCE}"}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"tell me about {MARKER}"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    ok = httpx.post(keyed.v1 + "/chat/completions", json=chat, headers=inference, timeout=60)
    assert ok.status_code == 200
    stream = httpx.post(
        keyed.v1 + "/chat/completions", json={**chat, "stream": True}, headers=inference
    )
    assert stream.status_code == 200
    text = {"model": "tiny", "prompt": MARKER, "max_tokens": 2}
    assert httpx.post(keyed.v1 + "/completions", json=text, headers=inference).status_code == 200
    refused = [
        {**chat, "max_tokens": 10**6},  # over the context: 400 after tokenization
        {**chat, "top_k": 100_000},  # refused by the worker (top_k over the vocabulary)
        {**chat, "messages": [{"role": "wizard", "content": MARKER}]},
        {**chat, "stop": [MARKER] * 100},
    ]
    for body in refused:
        r = httpx.post(keyed.v1 + "/chat/completions", json=body, headers=inference, timeout=60)
        assert r.status_code == 400, r.text
    bad_key = {"Authorization": f"Bearer {MARKER}-key"}
    assert httpx.post(keyed.v1 + "/completions", json=text, headers=bad_key).status_code == 401
    log = keyed.log()
    assert '"key_name": "app"' in log  # the request lines are there, with the key's name
    for secret in (MARKER, INFERENCE, ADMIN):
        assert secret not in log, f"{secret!r} reached the log"
