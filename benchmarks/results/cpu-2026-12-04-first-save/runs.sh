# /tmp/wtC/base: git archive 580f1c4 (the parent of the fix) plus the built .so files and benchmarks/first_save.py; /work/wtC: i37-fio. PYTHONDONTWRITEBYTECODE=1 in this environment.
set -x
cd /work/wtC
B=/work/main/.venv/bin/python
date -u; uptime
(cd /tmp/wtC/base && PYTHONPATH=/tmp/wtC/base $B benchmarks/first_save.py --no-peers --rounds 5)
date -u; uptime
PYTHONPATH=/work/wtC $B benchmarks/first_save.py --no-peers --rounds 5
date -u; uptime
PYTHONPATH=/work/wtC $B benchmarks/first_save.py --rounds 5 --json /tmp/wtC/after_peers.json
date -u; uptime
(cd /tmp/wtC/base && PYTHONPATH=/tmp/wtC/base $B benchmarks/first_save.py --no-peers --rounds 5)
date -u; uptime
