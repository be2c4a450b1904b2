"""Worker process exit codes: the contract between the worker and its supervisor.

The supervisor restarts a worker that crashed, but a worker that cannot ever
start (bad configuration, a model that does not load) must not be restarted in a
loop, so those failures have exit codes of their own. A model that did not fit
in memory at this moment (other processes on the GPU or in RAM hold it) may fit
later: that load failure has a code of its own too, and is restarted as a crash
is (with the crash budget's backoff and, once spent, its cool-down).
"""

from typing import Final

OK: Final = 0
CRASH: Final = 1  # uncaught error while serving: restartable
PROTOCOL: Final = 4  # the gateway spoke an incompatible protocol: restartable
NO_MEMORY: Final = 75  # EX_TEMPFAIL: out of memory while loading: restartable
MODEL_LOAD: Final = 77  # the model failed to load: not restartable
BAD_CONFIG: Final = 78  # EX_CONFIG: invalid worker configuration: not restartable

NOT_RESTARTABLE: Final = frozenset({MODEL_LOAD, BAD_CONFIG})


# What MLX raises when an allocation fails: cudaMalloc(Async) on CUDA, its
# allocator's own message on Metal and the CPU, and Python's MemoryError.
_NO_MEMORY_MARKERS = ("out of memory", "unable to allocate")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed (worker/core.py recovers a
    step that raised one; a load that raised one may fit later)."""
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return any(m in text for m in _NO_MEMORY_MARKERS)


def load_failure_code(error: BaseException) -> int:
    """The exit code of a worker whose model load raised `error`."""
    return NO_MEMORY if is_out_of_memory(error) else MODEL_LOAD


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
        NO_MEMORY: "out of memory while loading the model",
        MODEL_LOAD: "model failed to load",
        BAD_CONFIG: "invalid worker configuration",
    }.get(code, f"exited with status {code}")
