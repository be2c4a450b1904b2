"""Worker process exit codes: the contract between the worker and its supervisor.

The supervisor restarts a worker that crashed, but a worker that cannot ever
start (bad configuration, a model that does not load) must not be restarted in a
loop, so those failures have exit codes of their own.
"""

from typing import Final

OK: Final = 0
CRASH: Final = 1  # uncaught error while serving: restartable
PROTOCOL: Final = 4  # the gateway spoke an incompatible protocol: restartable
MODEL_LOAD: Final = 77  # the model failed to load: not restartable
BAD_CONFIG: Final = 78  # EX_CONFIG: invalid worker configuration: not restartable

NOT_RESTARTABLE: Final = frozenset({MODEL_LOAD, BAD_CONFIG})


def describe(code: int) -> str:
    """A short human reason for an exit status (negative: killed by a signal)."""
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if name == "SIGKILL":
            # On unified memory the kernel's OOM killer is the usual sender.
            return "killed by SIGKILL (often out of memory)"
        return f"killed by {name}"
    return {
        OK: "exited cleanly",
        CRASH: "crashed",
        PROTOCOL: "protocol error",
        MODEL_LOAD: "model failed to load",
        BAD_CONFIG: "invalid worker configuration",
    }.get(code, f"exited with status {code}")
