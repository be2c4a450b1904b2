# Stage 2 (session 43): the primitives a step hands MLX on CUDA, a decode
# step of 16 streams against each step of a 2,000-token prompt arriving
# beside them (fused, padded, the planner's chunks): on the CPU a chunk adds
# about 64 a layer, fallbacks included (docs/benchmarks/README.md, session
# 43); on CUDA each that computes is a kernel launch, and the 0.5B shape's
# chunk step costs about 4 ms over a decode step whatever its size.
try ops-05b 120 python3 -m bench.pacing_probe --shape qwen0.5b --streams 16 --prompt 2000 --fused on --count-ops --calibrated-only --out "$R/ops-05b.json"
