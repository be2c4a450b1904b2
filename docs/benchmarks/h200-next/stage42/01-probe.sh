# Stage 1: the variant probe with `buffers` (the worker's decode pass since
# session 42) as the reference, against `rotary` (its kernel, now off by
# default) and `nodes` (session 39's pass): decode steps paired by round,
# fused steps matched by their place in the prompt (bench/variant_probe.py).
try variant-05b 150 python3 -m bench.variant_probe --shape qwen0.5b --variants buffers,rotary,nodes --rounds 60 --prompt 2000 --out "$R/variant-05b.json"
[ "$(left)" -gt 120 ] && { timeout 200 python3 -c "from bench.models import shape_model; shape_model('llama8b')"; step model-llama8b $?; }
try variant-8b 120 python3 -m bench.variant_probe --shape llama8b --variants buffers,rotary,nodes --rounds 60 --prompt 2000 --out "$R/variant-8b.json"
