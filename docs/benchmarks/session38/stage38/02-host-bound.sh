# Stage 2: is a decode step host-bound? The host pass of this job's admit
# probe showed the host inside GenerationBatch._step for as long as the
# device takes (10 ms a decode step, 18 a paced one) with no wait in mx.eval,
# and the synchronised passes took host + device (16-18 ms a decode step).
# bench.step_probe's decode steps, 16 rows, engine (with a cProfile of its
# last rep) and mlx-lm's BatchGenerator (ceiling), CUDA graphs off (mlxd's
# setting) and on, llama8b, then the engine on the 0.5B shape.
sp="python3 -m bench.step_probe"
export MLXD_STEP_PROBE_REPS=3
try sp-8b-engine 150 env MLXD_STEP_PROBE_PROFILE=1 $sp llama8b engine 16 > "$R/sp-8b-engine.log" 2>&1
try sp-8b-ceiling 120 $sp llama8b ceiling 16 > "$R/sp-8b-ceiling.log" 2>&1
try sp-8b-engine-graphs 150 env MLX_USE_CUDA_GRAPHS=1 $sp llama8b engine 16 > "$R/sp-8b-engine-graphs.log" 2>&1
try sp-8b-ceiling-graphs 120 env MLX_USE_CUDA_GRAPHS=1 $sp llama8b ceiling 16 > "$R/sp-8b-ceiling-graphs.log" 2>&1
try sp-05b-engine 200 env MLXD_STEP_PROBE_PROFILE=1 $sp qwen0.5b engine 16 > "$R/sp-05b-engine.log" 2>&1
try sp-05b-ceiling 120 $sp qwen0.5b ceiling 16 > "$R/sp-05b-ceiling.log" 2>&1
