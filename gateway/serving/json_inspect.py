"""What the JSON helper process runs (gateway/serving/json_precheck.py).

Kept free of heavy imports: the helper is a fresh (spawned) interpreter that
imports only this module. Threading: runs in the helper process only.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any


def init_child() -> None:
    """Never outlive the gateway (as the worker does: PR_SET_PDEATHSIG on Linux)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def inspect(raw: bytes, max_values: int) -> tuple[str, str]:
    """("ok", n) | ("invalid", why) | ("deep", "") | ("too_many", n): the body's verdict."""
    try:
        data = json.loads(raw)
    except RecursionError:
        return "deep", ""
    except (UnicodeDecodeError, ValueError) as e:
        return "invalid", str(e)
    count = 0
    stack: list[Any] = [data]
    while stack:  # iterative: a deep body must not recurse here
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            count += len(value)  # the keys
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        if count > max_values:
            return "too_many", str(count)
    return "ok", str(count)
