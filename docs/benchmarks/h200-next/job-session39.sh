#!/bin/bash
# A staged job (session 38's design, ../session38/job-session38.sh): the
# stages in stage39/ run one after another, in name order, each sourced in
# a subshell with common.sh's functions, until the budget ends or a stage
# whose name holds "last" has run. The stages in the tree at launch run at
# once; each poll call (poll-staged.sh) brings the session's work tree to
# ~/incoming, so a stage (and code) written while the job runs is run next,
# the tree copied to ~/proj first.
#
# Planned (session 38's finding: a CUDA step is bound by the host's work,
# docs/benchmarks/README.md): 01, CUDA graphs on and off through mlxd on
# the 0.5B shape (mixed pressure, long prefill, C=16 and 64), alternated
# twice; 02, one pair on llama8b.
SHAPE=qwen0.5b
. "$(dirname "$0")/common.sh"
[ -d "$HOME/incoming" ] || cp -a "$HOME/proj" "$HOME/incoming"
ran=" "
while [ "$(left)" -gt 40 ]; do
  next=""
  for f in "$HOME"/incoming/docs/benchmarks/h200-next/stage39/*.sh; do
    [ -e "$f" ] || continue
    case "$ran" in *" $(basename "$f") "*) continue ;; esac
    next=$(basename "$f")
    break
  done
  if [ -z "$next" ]; then sleep 5; continue; fi
  ran="$ran$next "
  (flock 9; rm -rf "$HOME/proj.new" && cp -a "$HOME/incoming" "$HOME/proj.new") 9> "$HOME/incoming.lock"
  rm -rf "$HOME/proj" && mv "$HOME/proj.new" "$HOME/proj"
  cd "$HOME/proj" || break
  step "stage-$next-begin" 0
  ( . "$HOME/proj/docs/benchmarks/h200-next/stage39/$next" )
  step "stage-$next" $?
  case "$next" in *last*) break ;; esac
done
echo DONE >> "$R/steps"
