# Stage 2: mlxd at session 42's defaults (`join_read` on, the rotary kernel
# off, the bound on a paced pass from paced passes only; session 44's prompt
# attention is off by default until stage 1 and stage 5 measure it), both
# shapes: the long prompt idle and under mixed pressure with the step trace, the shared
# prefix's warm and cold turns, and sweeps. The 0.5B shape first: its model
# is made at the job's start; the 8B model is made here, once, and kept
# across stages (common.sh).
for s in "qwen0.5b long_prefill,mixed_pressure,shared_prefix,sweep_c16,sweep_c64" "llama8b long_prefill,mixed_pressure,shared_prefix,sweep_c16"; do
  set -- $s
  [ "$(left)" -gt 150 ] || break
  if [ "$1" = llama8b ]; then
    timeout 200 python3 -c "from bench.models import shape_model; shape_model('llama8b')"
    step model-llama8b $?
  fi
  timeout $(($(left) - 20)) python3 -m bench run --preset standard --shape "$1" --quiet --targets mlxd --scenarios "$2" --step-trace --out "$R/mlxd-$1" > "$R/mlxd-$1.log" 2>&1
  step "mlxd-$1" $?
done
