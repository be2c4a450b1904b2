# Stage 3 (the last): the admit probe's pipelined and host passes on the
# 0.5B shape, whose decode step is far lighter on the device: the joining
# step's wait and host time there.
try admit-05b 110 python3 -m bench.admit_probe --shape qwen0.5b --chunk 256 --prompts 2000 --reps 4 --passes default,host --out "$R/admit-05b.json"
