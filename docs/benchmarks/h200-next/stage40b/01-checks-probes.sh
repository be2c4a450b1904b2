# Stage 1: the CUDA kernels' own tests (the decode attention kernel over
# whole buffers and flat, the rotary kernel against MLX's RoPE), then the
# variant probe (nodes: session 39's pass; buffers: the decode rows' caches
# written in place; rotary: and their heads made and rotated by one kernel,
# the worker's default) and the build probe on both shapes.
try cuda-tests 200 bash -c "python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_decode_attention.py tests/test_decode_rotary.py -k on_cuda > $R/cuda-tests.txt 2>&1"
try variant-05b 150 python3 -m bench.variant_probe --shape qwen0.5b --variants nodes,buffers,rotary --rounds 60 --prompt 2000 --out "$R/variant-05b.json"
timeout 300 python3 -c "from bench.models import shape_model; shape_model('llama8b')"
step model-llama8b $?
try variant-8b 200 python3 -m bench.variant_probe --shape llama8b --variants nodes,buffers,rotary --rounds 60 --prompt 2000 --out "$R/variant-8b.json"
try build-05b 120 python3 -m bench.build_probe --shape qwen0.5b --reps 150 --out "$R/build-05b.json"
try build-8b 120 python3 -m bench.build_probe --shape llama8b --reps 150 --out "$R/build-8b.json"
