cd /work/main
for i in 1 2 3; do
 for v in rows base; do
  if [ $v = rows ]; then env="--mlxd-env MLXD_FUSED_STEP=on --mlxd-env MLXD_DECODE_ROWS=on"; else env=""; fi
  .venv/bin/python -m bench run --preset smoke --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace $env --out bench/results/rab-$v-$i > /tmp/rab-$v-$i.log 2>&1
 done
done
echo DONE
