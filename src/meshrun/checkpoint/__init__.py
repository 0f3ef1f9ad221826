"""Checkpoints: DCP save/load behind a restricted unpickler (`dcp`), where a run's checkpoints are
and which are complete (`paths`, torch-free), and one consolidated file from one (`export`)."""
