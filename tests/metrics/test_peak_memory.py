"""A rank's CPU peak memory is its own: getrusage's ru_maxrss survives execve, so a worker started
by a large process (a pytest worker, a launcher that built a model) read its parent's peak."""

from __future__ import annotations

import subprocess
import sys

from meshrun.hardware.device import peak_rss_bytes

PARENT_BYTES = 600 * 2**20


def test_a_child_started_by_a_large_process_reads_its_own_peak() -> None:
    held = bytearray(PARENT_BYTES)
    held[::4096] = b"\1" * len(range(0, PARENT_BYTES, 4096))  # touch every page: resident
    assert peak_rss_bytes() > PARENT_BYTES
    code = "from meshrun.hardware.device import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 10 * 2**20 < child < PARENT_BYTES / 2, child
    del held
