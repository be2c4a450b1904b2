#!/bin/bash
# Session 24's third job (JOB_BUDGET_S about 330): what the step in which a
# paced prompt joins the decode rows is made of, on llama8b's dimensions
# (random tensors, no model). job-session24b.sh's synchronised pacing probe:
# that step cost 21.8-23.4 ms of its own against 7.9 for a decode step and
# 8.6-11 for the steps after it (the same 17 rows over the joined buffer),
# and the same the second time (not a first use). Its extra work is the
# join, worker/batch_padding.py's one_write_extend on every layer (a zeroed
# 17-row buffer and two copies, keys and values): bench.shape_probe times it
# (and mlx-lm's), bench.decode_probe the decode attention at those lengths,
# and the snippet below the zero fill alone and the join at mixed
# pressure's sizes (16 rows at 100 of 256 slots, one at 2,000 of 2,048).
SHAPE=tiny  # common.sh makes its model; nothing here loads one
. "$(dirname "$0")/common.sh"
try shape-probe 120 python3 -m bench.shape_probe --shape llama8b --out "$R/shape-probe.json" > "$R/shape-probe.txt" 2>&1
try decode-probe 120 python3 -m bench.decode_probe --shape llama8b --out "$R/decode-probe.json" > "$R/decode-probe.txt" 2>&1
try join-parts 90 python3 - > "$R/join-parts.txt" 2>&1 <<'PY'
import time
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache
from worker import batch_padding

batch_padding.install()
L, H, D, bf = 32, 8, 128, mx.bfloat16

def timed(fn, reps=5):
    out = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        fn()
        mx.synchronize()
        out.append(round(1e3 * (time.perf_counter() - t), 3))
    return out

def layers(rows, n):
    out = []
    for _ in range(L):
        c = BatchKVCache([0] * rows)
        k = mx.random.normal((rows, H, n, D)).astype(bf)
        c.update_and_fetch(k, k)
        out.append(c)
    mx.eval([c.state for c in out])
    return out

print("zeros 64 x (17,8,2048,128)", timed(lambda: mx.eval([mx.zeros((17, H, 2048, D), bf) for _ in range(2 * L)])))
print("zeros 64 x (17,8,2304,128)", timed(lambda: mx.eval([mx.zeros((17, H, 2304, D), bf) for _ in range(2 * L)])))
for short in (100, 600):
    def join():
        a, b = layers(16, short), layers(1, 2000)
        mx.synchronize()
        t = time.perf_counter()
        for x, y in zip(a, b):
            x.extend(y)
        mx.eval([c.state for c in a])
        mx.synchronize()
        return round(1e3 * (time.perf_counter() - t), 3)
    print(f"one_write_extend 16x{short} + 1x2000", [join() for _ in range(5)])
a = layers(17, 2000)
k = mx.random.normal((17, H, 1, D)).astype(bf)
mx.eval(k)
print("decode write 17 rows over 2048", timed(lambda: mx.eval([c.update_and_fetch(k, k) for c in a])))
PY
echo DONE >> "$R/steps"
