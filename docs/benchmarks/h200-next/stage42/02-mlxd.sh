# Stage 2: mlxd at session 42's defaults, both shapes: the long prompt idle
# and under mixed pressure with the step trace, the shared prefix's warm and
# cold turns (issue #12 item 5: where a warm turn goes), and sweeps. The 8B model is
# made once (stage 1) and kept across stages (common.sh, session 42).
for s in "qwen0.5b long_prefill,mixed_pressure,shared_prefix,sweep_c16,sweep_c64" "llama8b long_prefill,mixed_pressure,shared_prefix,sweep_c16"; do
  set -- $s
  [ "$(left)" -gt 100 ] || break
  timeout $(($(left) - 20)) python3 -m bench run --preset standard --shape "$1" --quiet --targets mlxd --scenarios "$2" --step-trace --out "$R/mlxd-$1" > "$R/mlxd-$1.log" 2>&1
  step "mlxd-$1" $?
done
