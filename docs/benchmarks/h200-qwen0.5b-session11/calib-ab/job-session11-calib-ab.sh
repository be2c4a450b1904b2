#!/bin/bash
# Session 11, with the device time left after the final run (about 11
# minutes): the final run's mixed pressure (long TTFT 3.96x idle, gap 3.12x)
# was worse than session 10's (0.72x, 2.47x), and the one engine change
# between them that touches pacing is the timed calibration (1835a92). A/B in
# one machine: mlxd alone on the long-prefill and mixed-pressure scenarios,
# alternating the tree as it is (A) with a copy whose calibration queues its
# passes as serving does (B: `runner.timed_passes = True` made False in
# worker/calibrate.py, session 10's behaviour), two of each.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
rm -rf ~/projB && cp -r ~/proj ~/projB
sed -i 's/runner.timed_passes = True/runner.timed_passes = False/' ~/projB/worker/calibrate.py
grep -n "timed_passes = " ~/projB/worker/calibrate.py > $R/B-patch.txt
for i in 1 2; do
  for v in A B; do
    d=$HOME/proj; [ $v = B ] && d=$HOME/projB
    (cd $d && PYTHONPATH=$HOME/site:$d timeout 150 python3 -m bench run --preset standard --model $M --targets mlxd --scenarios long_prefill,mixed_pressure --quiet --out $R/$v$i > $R/$v$i.log 2>&1)
    step $v$i $?
  done
done
echo DONE >> "$R/steps"
