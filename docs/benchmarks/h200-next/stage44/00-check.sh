# Stage 0 (session 44): worker/prompt_attention.py on CUDA against MLX's
# attention (its fallback, cuDNN's off as in the worker), at both shapes'
# heads in bfloat16: a 256-token chunk (padded to 288 queries, as a padded
# pass runs it) over 2,048 keys, two rows, one left-padded; the largest
# difference and each one's synchronised time over 24 calls. Where they
# differ by more than bf16 rounding allows, $R/pa-off makes the stages
# that turn it on skip.
REPS=${CHECK_REPS:-24} timeout 240 python3 - > "$R/check.json" 2> "$R/check.log" <<'PY'
import json, os, time
from worker.backend import apply_env
apply_env("auto")
import mlx.core as mx
from worker import prompt_attention as pa
out = {}
reps = int(os.environ["REPS"])
for name, heads, kv, size in (("qwen0.5b", 14, 2, 64), ("llama8b", 32, 8, 128)):
    mx.random.seed(0)
    rows, queries, real, keys = 2, 288, 256, 2048
    q = mx.random.normal((rows, heads, queries, size)).astype(mx.bfloat16)
    k, v = (mx.random.normal((rows, kv, keys, size)).astype(mx.bfloat16) for _ in range(2))
    qi = mx.arange(queries)[:, None] + 1500 - real
    mask = (mx.arange(keys)[None] <= qi)[None, None] & (mx.arange(keys) >= mx.array([[0], [37]]).reshape(2, 1, 1, 1))
    mask = mask | (mx.arange(queries)[:, None] >= real)[None, None]  # padded rows attend all
    bias = pa.bias(mask, heads, kv, mx.bfloat16)
    scale = size**-0.5
    ours = lambda: pa.attention(q, k, v, scale, bias)
    theirs = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    diff = mx.abs(ours().astype(mx.float32) - theirs().astype(mx.float32)).max().item()
    times = {}
    for label, f in (("ours", ours), ("mlx", theirs), ("ours2", ours), ("mlx2", theirs)):
        mx.synchronize(); t = time.perf_counter()
        for _ in range(reps):
            mx.eval(f())
        mx.synchronize(); times[label] = round((time.perf_counter() - t) / reps * 1e3, 4)
    out[name] = {"max_abs_diff": diff, "ms_per_call": times}
print(json.dumps(out))
ok = all(r["max_abs_diff"] < 0.05 for r in out.values())
raise SystemExit(0 if ok else 3)
PY
rc=$?
step check $rc
[ "$rc" = 0 ] || touch "$R/pa-off"
