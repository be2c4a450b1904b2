# Stage 1: MLX's CUDA graphs on and off through mlxd alone on the 0.5B
# shape, alternated twice. Off since session 5 (every new prefill shape
# cost 60-90 ms with them on); since session 17 the padded passes keep
# those shapes few and warmed, and in session 38 graphs took mlx-lm's own
# decode step from 13 to 9 ms on the 8B shape, where the engine's step is
# bound by the host's work.
setting_ab MLXD_CUDA_GRAPHS graphs-05b qwen0.5b 180 long_prefill,mixed_pressure,sweep_c16,sweep_c64
