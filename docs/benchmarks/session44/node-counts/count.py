"""A step's primitives by kind: a decode step of 16 rows, then each step of a
1,000-token prompt arriving beside them in 256-token chunks (no warm-up).

    python count.py MODEL_DIR on|off OUT.json   (on|off: pad_rows)
"""

import json
import sys
from pathlib import Path

from bench.pacing_probe import primitives_of
from protocol.messages import Add, SamplingParams
from protocol.worker_config import WorkerConfig
from worker.core import core_for
from worker.runner import Runner

model, pad, out = Path(sys.argv[1]), sys.argv[2] == "on", Path(sys.argv[3])
runner = Runner(model, max_batch=32, prefill_batch=8, prefill_chunk=256, fused=True, pad_rows=pad)
core = core_for(WorkerConfig(socket="", model=str(model), fused_step="on"), runner)
greedy = SamplingParams(temperature=0.0)
for i in range(16):
    core.add(Add(f"s{i}", [(5 * i + j) % 4000 + 10 for j in range(32)], 4000, greedy))
for _ in range(10):
    core.step()
assert runner.decoding == 16, runner.decoding
core._forced_chunk = 256
ops = {"decode": primitives_of(core.step)}
core.add(Add("long", [(13 * j + 5) % 4000 + 10 for j in range(1000)], 1, greedy))
request = core.requests["long"]
while request.first_token_at is None and "long" in core.requests:
    ops[f"a{len(ops)}"] = primitives_of(core.step)
print(json.dumps({k: sum(v.values()) for k, v in ops.items()}))
out.write_text(json.dumps(ops))
