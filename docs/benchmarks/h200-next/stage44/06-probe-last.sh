# Stage 6 (the last, while time is left): stage 1's A/B on the 8B shape.
[ -e "$R/pa-off" ] && return
try variant-8b 200 python3 -m bench.variant_probe --shape llama8b --variants buffers,attention --rounds 40 --prompt 2000 --out "$R/variant-8b.json"
