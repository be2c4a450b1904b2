# Stage 4 (the last, while time is left): session 42's variant probe on the
# 0.5B shape, fused steps matched by their place in the prompt: `buffers`
# (the worker's decode pass) against `rotary` (its kernel, off by default)
# and `nodes` (session 39's pass).
try variant-05b 150 python3 -m bench.variant_probe --shape qwen0.5b --variants buffers,rotary,nodes --rounds 60 --prompt 2000 --out "$R/variant-05b.json"
