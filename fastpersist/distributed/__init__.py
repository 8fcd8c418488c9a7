"""Distributed checkpoints: one writer per unique byte across the job's ranks.

planner.py      who writes what (pure, deterministic, cached)
describe.py     a rank's tensors as boxes of global tensors (plain and DTensor)
layout.py       storage domains, the pieces a rank holds, the job manifest
coordinator.py  the save protocol over a gloo group of its own
phases.py       that group, and every rank's agreement on each phase
storage.py      where the bytes go: in-process, or through each node's fastpersistd
restore.py      loading in any job size or layout (resharding)
"""
