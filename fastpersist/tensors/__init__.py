"""Tensors and the state tree: encoding a state (state.py), planning its
bytes (plan.py), data files (datafile.py), building tensors on load
(factory.py), reading a checkpoint back (its manifest and files in
committed.py, its tensors in checkpoint.py, the data files' own headers in
headers.py) and verifying one (verifying.py). committed, mismatch, headers and
verifying import no torch: fpctl's ls, inspect and verify use only them.
"""
