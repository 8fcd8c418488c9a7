"""The codec: tensor bytes <-> stored bytes, torch-free (numpy and zstandard).

`planes.py` regroups each element's bytes into byte planes, `frame.py` turns
one frame of raw bytes into its stored form and back, and `frames.py` runs
the frames of many tensors in parallel threads (zstandard and numpy release
the GIL) with their checksums. The format of the index that records where
each frame lies is format/frames.py's.
"""
