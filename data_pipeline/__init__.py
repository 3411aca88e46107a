"""Data pipelines for dynts: traces, datasets and the synthetic testbed."""
