"""Tensors and the state tree: encoding a state (state.py), planning its
bytes (plan.py), data files (datafile.py), building tensors on load
(factory.py) and reading a checkpoint back (checkpoint.py).
"""
