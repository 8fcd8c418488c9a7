"""The on-disk format: safetensors data files and a JSON manifest. No I/O here."""
