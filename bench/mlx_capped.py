"""`python -m bench.mlx_capped LIMIT_BYTES MODULE [ARGS...]`: MODULE run as
`python -m MODULE ARGS...` with MLX's memory limit set to LIMIT_BYTES first.

For a target the benchmark cannot configure otherwise (mlx_lm.server, the
peer) when several share one GPU in an interleaved run (bench/run.py,
`memory_share`): MLX's allocator keeps freed buffers until its process holds
95% of the device, so five processes with 8B weights ran it out of memory
(session 12). The limit is soft (worker/backend.py): an allocation past it
first gives MLX's cached buffers back.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    limit, module, *rest = argv
    import mlx.core as mx

    mx.set_memory_limit(int(limit))
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
