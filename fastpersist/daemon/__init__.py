"""fastpersistd: the per-node checkpoint daemon (see proto/fastpersist.proto).

Torch-free: it imports the engine, the format and commit, never the API.
"""
