"""The object-store tier: committed checkpoints copied to S3, and read back.

    url.py       s3://BUCKET/PREFIX, and the object keys below it
    client.py    the boto3 client, configured the standard AWS way
    upload.py    one checkpoint directory, data files in parallel parts, the
                 manifest last with a conditional put
    uploader.py  the background queue: newest first, retried, never blocking
    mirror.py    a Checkpointer's root mirrored to its tier
    remote.py    reading: manifests, listings, ranged GETs into memory
    retention.py keep_last in the store; abandoned uploads

A remote checkpoint is visible exactly when its manifest.json is there, and
that is written last. Torch-free: fastpersistd uploads with it; the reading
of tensors is tensors/tier_read.py.
"""
