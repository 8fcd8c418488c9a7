#!/usr/bin/env bash
# Issue 35's two throughput goals measured on a machine with more cores than the
# 2-vCPU development VM (the device tool's H200 host: 16 cores, 128 GiB), to see
# whether the 2 vCPUs or the code is the limit. Logs go to ${OUT:-.bench/many}.
#
#   run(command="bash benchmarks/many_cores_run.sh", carry=[".whl"], timeout_s=480)
#
# No moto server there, so time_to_resume runs without its object-store row.
set -uo pipefail
out=${OUT:-.bench/many}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nproc; free -g; python3 setup.py -q build_ext --inplace 2>&1 | tail -3; } 2>&1 | tee "$out/env.log"
[ -n "${SKIP_REPLICATION:-}" ] || timeout 200 python3 benchmarks/replication.py --size-gib 1 --rounds 5 \
    --json "$out/replication.json" 2>&1 | tee "$out/replication.log"
timeout 240 python3 benchmarks/time_to_resume.py --size-gib 2 --repeats 5 --drop data \
    --methods memory,disk,dcp,peer --json "$out/time_to_resume.json" 2>&1 | tee "$out/time_to_resume.log"
