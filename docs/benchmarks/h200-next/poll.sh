#!/bin/bash
# Waits up to SECONDS for the job's DONE (printing the steps timeline), then
# packs ~/R and the logs into $OUT/r.tgz: poll.sh SECONDS.
end=$(($(date +%s) + $1))
while [ "$(date +%s)" -lt "$end" ]; do
  grep -q DONE ~/R/steps 2>/dev/null && break
  sleep 10
done
cat ~/R/steps 2>/dev/null; tail -3 ~/job.log
tar czf "$OUT/r.tgz" -C ~ R job.log pip.log 2>/dev/null
ls -la "$OUT"
