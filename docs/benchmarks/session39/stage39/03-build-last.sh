# Stage 3 (the last): the host's time to build one 16-row decode pass and
# its primitives (bench.build_probe, session 38), on both shapes: the
# Python third of a host-bound CUDA step, measured apart.
try build-05b 150 python3 -m bench.build_probe --shape qwen0.5b --out "$R/build-05b.json"
try build-8b 200 python3 -m bench.build_probe --shape llama8b --out "$R/build-8b.json"
