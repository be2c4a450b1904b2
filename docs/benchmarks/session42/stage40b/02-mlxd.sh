# Stage 2: mlxd with session 40's pass (and session 41's calibration, two
# paced prompts, and cost model guard) on the scenarios the first job ran
# with session 39's (../stage40/02-mlxd-last.sh), once on each shape.
for s in "qwen0.5b long_prefill,mixed_pressure,sweep_c16,sweep_c64" "llama8b long_prefill,mixed_pressure,sweep_c16"; do
  set -- $s
  [ "$(left)" -gt 100 ] || break
  timeout $(($(left) - 20)) python3 -m bench run --preset standard --shape "$1" --quiet --targets mlxd --scenarios "$2" --step-trace --out "$R/rotary-$1" > "$R/rotary-$1.log" 2>&1
  step "rotary-$1" $?
done
