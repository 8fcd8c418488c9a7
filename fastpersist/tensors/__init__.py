"""Tensors and the state tree: encoding a state (state.py), planning its
bytes (plan.py), data files (datafile.py), building tensors on load
(factory.py), reading a checkpoint back (checkpoint.py, with the data files'
own headers in headers.py) and verifying one (verifying.py).
"""
