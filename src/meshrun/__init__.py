"""meshrun: launch DDP x pipeline-parallel Transformer training that provably matches one process."""

__version__ = "0.1.0"
