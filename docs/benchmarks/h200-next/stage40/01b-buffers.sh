# Stage 1b (added while the job ran, session 40): the tree now holds session
# 40's decode pass (worker/fused.py `buffer_decode`); the variant probe
# measures it against session 39's (nodes), then the build probe counts it.
grep -c buffer_decode worker/fused.py > "$R/tree-01b.txt"
try variant-8b-buffers 150 python3 -m bench.variant_probe --shape llama8b --variants nodes,buffers --rounds 60 --prompt 2000 --out "$R/variant-8b-buffers.json"
try variant-05b-buffers 120 python3 -m bench.variant_probe --shape qwen0.5b --variants nodes,buffers --rounds 60 --prompt 2000 --out "$R/variant-05b-buffers.json"
try build-8b-buffers 120 python3 -m bench.build_probe --shape llama8b --reps 150 --out "$R/build-8b-buffers.json"
