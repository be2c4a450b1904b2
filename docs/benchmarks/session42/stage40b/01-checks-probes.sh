# Stage 1: the variant probe (nodes: session 39's pass; buffers: the
# caches written in place, the decode rows' read whole by the kernel;
# rotary: and their heads made and rotated by one kernel, the worker's
# default; each run records which kernels passed their checks), the CUDA
# kernels' own tests (the decode attention kernel over whole buffers and
# flat, the rotary kernel against MLX's RoPE), then the build probe.
try variant-05b 150 python3 -m bench.variant_probe --shape qwen0.5b --variants nodes,buffers,rotary --rounds 60 --prompt 2000 --out "$R/variant-05b.json"
[ "$(left)" -gt 120 ] && { timeout 200 python3 -c "from bench.models import shape_model; shape_model('llama8b')"; step model-llama8b $?; }
try variant-8b 120 python3 -m bench.variant_probe --shape llama8b --variants nodes,buffers,rotary --rounds 60 --prompt 2000 --out "$R/variant-8b.json"
try cuda-tests 120 bash -c "python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_decode_attention.py tests/test_decode_rotary.py -k on_cuda > $R/cuda-tests.txt 2>&1"
try build-8b 90 python3 -m bench.build_probe --shape llama8b --reps 150 --out "$R/build-8b.json"
try build-05b 90 python3 -m bench.build_probe --shape qwen0.5b --reps 150 --out "$R/build-05b.json"
