"""The daemon's protocol, client side: the gRPC client (client.py), the
channel an address names (channels.py) and the shared-memory segments both
sides map (shm.py).

Torch-free: the daemon imports shm.py.
"""
