"""The one read path: load_from(source) over any Source (tensors/source.py),
and source_for, the one place that chooses where a load reads from."""
