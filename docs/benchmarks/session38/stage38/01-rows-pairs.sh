# Stage 1 (sourced by job-session38.sh): decode_rows on and off, alternated
# twice, through mlxd alone on llama8b (mixed pressure and sustained decode,
# with the step trace, whose steps now carry their scratch). Since session
# 36 the layout keeps its rows' ends on the device between steps: did the
# 1.2-1.4 ms it added to every decode step go with the array made from host
# data each step?
mp="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios mixed_pressure,sustained_decode --step-trace"
for i in 1 2; do
  for v in on off; do
    [ "$(left)" -gt 120 ] || break 2
    timeout 150 $mp --mlxd-env "MLXD_DECODE_ROWS=$v" --out "$R/rows-$v-$i" > "$R/rows-$v-$i.log" 2>&1
    step "rows-$v-$i" $?
  done
done
