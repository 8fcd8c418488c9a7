"""Adapters between fastpersist and other checkpointing frameworks."""
