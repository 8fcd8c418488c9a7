#!/bin/bash
# A/B interleaved: base (HEAD at start) vs the worktree; args passed to benchmarks/replication.py
out=$1; shift; n=$1; shift
: > $out
for i in $(seq 1 $n); do
  for side in base new; do
    if [ $side = base ]; then d=/tmp/wt35r/base; else d=/work/wt35r; fi
    echo "=== $side run $i $(date -u +%T)" >> $out
    (cd $d && PYTHONPATH=$d timeout 600 /work/main/.venv/bin/python benchmarks/replication.py "$@" --json /tmp/wt35r/ab-$side-$i.json 2>&1 | tail -7) >> $out
  done
done
echo DONE >> $out
