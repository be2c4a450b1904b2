#!/bin/bash
# poll.sh for a staged job (job-session39.sh; session 38's ran as poll38.sh):
# first brings this call's work tree (the session's newest code and stage
# scripts) to ~/incoming for the job's next stage, then waits as poll.sh
# does: poll-staged.sh SECONDS.
mkdir -p ~/incoming.tmp
tar cf - --exclude=./.gpu --exclude=./.whl --exclude=./.venv --exclude=./bench/results . | (cd ~/incoming.tmp && tar xf -)
(flock 9; rm -rf ~/incoming && mv ~/incoming.tmp ~/incoming) 9> ~/incoming.lock
ls ~/incoming/docs/benchmarks/h200-next/stage*/ 2>/dev/null
exec bash ~/incoming/docs/benchmarks/h200-next/poll.sh "$1"
