# Stage 2: one pair of stage 1 on llama8b (its model made first).
M8=$(timeout 300 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))")
step model-llama8b $?
g="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure,sweep_c16 --step-trace"
for v in on off; do
  [ "$(left)" -gt 200 ] || break
  timeout 180 $g --mlxd-env "MLXD_CUDA_GRAPHS=$v" --out "$R/graphs-8b-$v" > "$R/graphs-8b-$v.log" 2>&1
  step "graphs-8b-$v" $?
done
