# pairs 1-3 (on first), then 4-6 (off first), tree 20b330b + this session's docs
cd /work/main
for i in 1 2 3; do
 for v in on off; do
  .venv/bin/python -m bench run --preset smoke --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace --mlxd-env MLXD_FUSED_STEP=$v --out bench/results/fab-$v-$i > /tmp/fab-$v-$i.log 2>&1
 done
done
echo FABDONE
cd /work/main
for i in 4 5 6; do
 for v in off on; do
  .venv/bin/python -m bench run --preset smoke --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace --mlxd-env MLXD_FUSED_STEP=$v --out bench/results/fab-$v-$i > /tmp/fab-$v-$i.log 2>&1
 done
done
echo FABDONE
