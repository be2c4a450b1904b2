# Stage 2 (the last): mlxd (compiled blocks, graphs off) on the scenarios of
# job-session39.sh's graphs-*-off runs, twice on each shape while time lasts.
for i in 1 2; do
  for s in "qwen0.5b long_prefill,mixed_pressure,sweep_c16,sweep_c64" "llama8b long_prefill,mixed_pressure,sweep_c16"; do
    set -- $s
    [ "$(left)" -gt 100 ] || break
    timeout $(($(left) - 20)) python3 -m bench run --preset standard --shape "$1" --quiet --targets mlxd --scenarios "$2" --step-trace --out "$R/compiled-$1-$i" > "$R/compiled-$1-$i.log" 2>&1
    step "compiled-$1-$i" $?
  done
done
