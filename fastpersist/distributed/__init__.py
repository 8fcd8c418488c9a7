"""Distributed checkpoints: one writer per unique byte across the job's ranks.

planner.py   who writes what (pure, deterministic, cached)
describe.py  a rank's tensors as boxes of global tensors (plain and DTensor)
coordinator.py  the save protocol over a gloo group of its own
restore.py   loading in any job size or layout (resharding)
"""
