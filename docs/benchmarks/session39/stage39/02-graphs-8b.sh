# Stage 2: stage 1 on llama8b (its model made first), a pair or two.
timeout 300 python3 -c "from bench.models import shape_model; shape_model('llama8b')"
step model-llama8b $?
setting_ab MLXD_CUDA_GRAPHS graphs-8b llama8b 180 long_prefill,mixed_pressure,sweep_c16
