# Stage 1: MLX's CUDA graphs on and off through mlxd alone on the 0.5B
# shape, alternated twice. Off since session 5 (every new prefill shape
# cost 60-90 ms with them on); since session 17 the padded passes keep
# those shapes few and warmed, and in session 38 graphs took mlx-lm's own
# decode step from 13 to 9 ms on the 8B shape, where the engine's step is
# bound by the host's work.
g="python3 -m bench run --preset standard --shape qwen0.5b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure,sweep_c16,sweep_c64 --step-trace"
for i in 1 2; do
  for v in on off; do
    [ "$(left)" -gt 200 ] || break 2
    timeout 180 $g --mlxd-env "MLXD_CUDA_GRAPHS=$v" --out "$R/graphs-05b-$v-$i" > "$R/graphs-05b-$v-$i.log" 2>&1
    step "graphs-05b-$v-$i" $?
  done
done
