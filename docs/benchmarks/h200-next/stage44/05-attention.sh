# Stage 5: mlxd on the 0.5B shape's long prompt idle and under mixed
# pressure, and the shared prefix's turns (on CUDA every prompt pass is
# fused_hidden's, so the idle and warm turns' passes change too), with
# session 44's prompt attention on against the default (off), alternated
# while a pair's time is left (common.sh `setting_ab`: on first).
[ -e "$R/pa-off" ] && return
setting_ab MLXD_PROMPT_ATTENTION attention qwen0.5b 200 long_prefill,mixed_pressure,shared_prefix
