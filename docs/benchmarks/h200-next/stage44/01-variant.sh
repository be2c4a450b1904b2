# Stage 1: a prompt chunk's attention in five nodes (`attention`, the
# worker's default since session 44) against MLX's fallback (`buffers`,
# session 42's pass), step by step in one engine on the 0.5B shape, fused
# steps matched by their place in the prompt (bench.variant_probe).
[ -e "$R/pa-off" ] && return
try variant-05b 170 python3 -m bench.variant_probe --shape qwen0.5b --variants buffers,attention --rounds 60 --prompt 2000 --out "$R/variant-05b.json"
