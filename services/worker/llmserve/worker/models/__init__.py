"""Model architectures, their registry and the checkpoint loader."""
