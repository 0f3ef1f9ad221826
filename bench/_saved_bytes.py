"""bench/pipeline.py's saved-bytes counter: the planner's (one implementation)."""

from meshrun.planner.saved_bytes import SavedBytes

__all__ = ["SavedBytes"]
