"""Measuring a run (throughput, MFU, memory) and sending the numbers somewhere (trackers, plots)."""
