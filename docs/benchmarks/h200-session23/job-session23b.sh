#!/bin/bash
# Session 23's second job (JOB_BUDGET_S about 450): `bench.variant_probe`,
# the step's variants in alternate steps of one engine (base: the model's own
# forward for decode; lean: `lean_decode`; joined: lean with joined
# projections), 16 streams, decode-only rounds then rounds with a 2,000-token
# prompt always arriving at a 256-token chunk. The first job's A/Bs between
# runners were swamped by the process's drift (llama8b's steady step 12.6,
# 11.6, 13.5 and 15.6 ms for off, on, on, off).
SHAPE=thin32
. "$(dirname "$0")/common.sh"
variants() {  # SHAPE SECONDS
  try "variants-$1" "$2" python3 -m bench.variant_probe --shape "$1" --streams 16 --rounds 60 \
    --prompt 2000 --chunk 256 --out "$R/variants-$1.json" > "$R/variants-$1.txt" 2>&1
}
variants thin32 150
try model-llama8b 150 python3 -c "from bench.models import shape_model; print(shape_model('llama8b'))"
variants llama8b 150
try model-qwen0.5b 60 python3 -c "from bench.models import shape_model; print(shape_model('qwen0.5b'))"
variants qwen0.5b 80
echo DONE >> "$R/steps"
