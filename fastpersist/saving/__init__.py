"""Saving a state: staging memory, the snapshot, the writer of one
checkpoint, the in-process and daemon-backed savers and their futures.

Chooses nothing: which saver runs a save is decided in api.py.
"""
