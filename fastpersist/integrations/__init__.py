"""Adapters that let training frameworks checkpoint through fastpersist.

    from fastpersist.integrations.lightning import FastPersistCheckpointIO   # Lightning
    from fastpersist.integrations.pytorch_lightning import FastPersistCheckpointIO
    from fastpersist.integrations.transformers import FastPersistTrainer     # transformers
    from fastpersist.integrations.accelerate import register                 # accelerate
    from fastpersist.integrations.dcp import FastPersistWriter, FastPersistReader  # DCP
    from fastpersist.integrations.torchtitan import FastPersistCheckpointManager  # torchtitan
    from fastpersist.integrations.deepspeed import use                       # DeepSpeed

Each adapter is a module of its own that imports fastpersist's public API (and
fastpersist.adapters, the adapters' contract) and its framework, and only when
it is imported: `import fastpersist` (and this
package) never imports a framework, and the frameworks are not dependencies of
fastpersist. The versions they are tested with are pinned in pyproject.toml's
`test` extra.
"""
