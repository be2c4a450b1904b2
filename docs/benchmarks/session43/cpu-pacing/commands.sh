# pairs 1-3 (3 first), then 4-6 (2 first); tree 20b330b + docs
for i in 1 2 3; do for v in 3 2; do
  .venv/bin/python -m bench run --preset smoke --quiet --targets mlxd --scenarios long_prefill,mixed_pressure --step-trace --mlxd-env MLXD_PACING_FACTOR=$v --out bench/results/pab-$v-$i
done; done  # then i in 4 5 6, v in 2 3
