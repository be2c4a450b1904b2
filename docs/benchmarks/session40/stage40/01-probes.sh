# Stage 1: the build probe (the worker's pass and session 38's, alternated)
# and the variant probe (rope: session 38's pass; nodes: session 39's) on
# both shapes.
try build-05b 150 python3 -m bench.build_probe --shape qwen0.5b --out "$R/build-05b.json"
timeout 300 python3 -c "from bench.models import shape_model; shape_model('llama8b')"
step model-llama8b $?
try build-8b 200 python3 -m bench.build_probe --shape llama8b --out "$R/build-8b.json"
try variant-8b 240 python3 -m bench.variant_probe --shape llama8b --variants rope,nodes --rounds 60 --prompt 2000 --out "$R/variant-8b.json"
try variant-05b 200 python3 -m bench.variant_probe --shape qwen0.5b --variants rope,nodes --rounds 60 --prompt 2000 --out "$R/variant-05b.json"
