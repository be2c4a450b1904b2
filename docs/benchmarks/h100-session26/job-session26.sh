#!/bin/bash
# Session 26 (JOB_BUDGET_S about 900; job-session25.sh's 1,600 s did not
# come: two machine starts refused, one machine taken back mid-call):
# (1) the 0.5B shape's standard preset on the engine as it stands (both
# ceilings, the engine, mlxd; session 24's ran before `reserve`), cut by
# its deadline; (2) llama8b mixed pressure through mlxd alone, twice, on
# the same engine (session 24's default runs were before `reserve` and the
# joint rope); (3) the q/k joint rotation A/B if time is left.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
if [ "$(left)" -gt 650 ]; then
  preset qwen0.5b ceiling,ceiling_alt,engine,mlxd "" std $(( $(left) > 900 ? 600 : $(left) - 330 ))
fi
try model-llama8b 200 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
mp="python3 -m bench run --preset standard --shape llama8b --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace"
for i in 1 2; do
  try "mp-llama8b-$i" 100 $mp --out "$R/mp-llama8b-$i" > "$R/mp-llama8b-$i.log" 2>&1
done
if [ "$(left)" -gt 200 ]; then
  try variants-llama8b 180 python3 -m bench.variant_probe --shape llama8b --streams 16 --rounds 60 \
    --prompt 2000 --chunk 256 --variants joined,rope --out "$R/variants-llama8b.json" > "$R/variants-llama8b.txt" 2>&1
fi
echo DONE >> "$R/steps"
