"""torch.distributed.checkpoint (DCP) storage on fastpersist.

    import torch.distributed.checkpoint as dcp
    from fastpersist.integrations.dcp import FastPersistReader, FastPersistWriter

    dcp.save(state_dict, storage_writer=FastPersistWriter("ckpt/step-100"))
    future = dcp.async_save(state_dict, storage_writer=FastPersistWriter("ckpt/step-200"))
    dcp.load(state_dict, storage_reader=FastPersistReader("ckpt/step-200"))

The checkpoint is a fastpersist checkpoint directory (fastpersist.load and
fpctl read it) plus dcp_metadata.json. Importing this package imports
torch.distributed.checkpoint; importing fastpersist does not.
"""

from .reader import FastPersistReader
from .stager import FastPersistStager
from .writer import FastPersistWriter

__all__ = ["FastPersistReader", "FastPersistStager", "FastPersistWriter"]
