"""This process's resident memory for benches that measure each side in a fresh process (Linux):
the high-water mark reset before the timed steps, so their peak is read above where they began."""

from __future__ import annotations

from pathlib import Path


def rss_kb(field: str) -> int:
    """A /proc/self/status field in kB: `VmRSS:` now, `VmHWM:` the peak since the last reset."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def reset_peak() -> int:
    """Start the high-water mark again here (/proc/self/clear_refs); returns the RSS now (kB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kb("VmRSS:")


def peak_mb_since(before_kb: int) -> float:
    """The peak since reset_peak, above its RSS then, in MB."""
    return (rss_kb("VmHWM:") - before_kb) / 1024
