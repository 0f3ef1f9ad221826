"""Progress lines for people: one prefix, on stderr, flushed (workers' output interleaves)."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    print(f"[meshrun] {message}", file=sys.stderr, flush=True)
