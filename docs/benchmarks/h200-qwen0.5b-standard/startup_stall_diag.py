"""Where a worker's start stalls (issue #12 part 6): `startup-stall-diag.txt` is its output.

    python3 docs/benchmarks/h200-qwen0.5b-standard/startup_stall_diag.py MODEL_DIR

Builds the worker's Runner with a faulthandler dump of every thread 40 s in (the
H200 run showed the loader waiting in `model_identity` while llguidance's tokenizer
build, then started at load in a thread, held the GIL), then the engine's warm-up.
"""

from __future__ import annotations

import faulthandler
import sys
import time
from pathlib import Path


def main(model_dir: str) -> None:
    faulthandler.dump_traceback_later(40, repeat=False, file=sys.stdout)
    from worker.backend import apply_env

    apply_env("auto")  # before MLX is imported, as the worker does
    start = time.perf_counter()
    from worker.runner import Runner

    print("import", round(time.perf_counter() - start, 2), flush=True)
    runner = Runner(Path(model_dir), max_batch=64)
    print("runner", round(time.perf_counter() - start, 2), flush=True)
    faulthandler.cancel_dump_traceback_later()
    from protocol.worker_config import WorkerConfig
    from worker.core import core_for

    core = core_for(WorkerConfig(socket="", model=model_dir, max_batch=64), runner)
    print("warm-up", round(core.warmup(), 2), flush=True)
    print("cost model", core.scheduler.cost.predict_coef(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
