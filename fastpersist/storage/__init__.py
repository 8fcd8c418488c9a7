"""Checkpoints on disk: the atomic commit, directory operations that never
follow a link, leftovers of interrupted saves, prepared parts of node-local
jobs, and retention (`latest`, keep_last/keep_every).

Knows directories, files and manifests' bytes, never torch: the daemon
imports it.
"""
