# Stage 3 (sessions 43 and 44): the primitives a step hands MLX on CUDA, a
# decode step of 16 streams against each step of a 2,000-token prompt
# arriving beside them (fused, padded, the planner's chunks): on the CPU a
# chunk adds about 61 a layer, fallbacks included, 49 with session 44's
# attention (docs/benchmarks/README.md); on CUDA each that computes is a
# kernel launch, and the 0.5B shape's chunk step cost about 4 ms over a
# decode step whatever its size (session 42).
# With session 44's prompt attention, then without (the default).
[ -e "$R/pa-off" ] || try ops-05b-pa 120 python3 -m bench.pacing_probe --shape qwen0.5b --streams 16 --prompt 2000 --fused on --count-ops --calibrated-only --prompt-attention on --out "$R/ops-05b-pa.json"
try ops-05b 120 python3 -m bench.pacing_probe --shape qwen0.5b --streams 16 --prompt 2000 --fused on --count-ops --calibrated-only --prompt-attention off --out "$R/ops-05b.json"
