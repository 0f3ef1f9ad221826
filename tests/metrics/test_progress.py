"""Rank 0's console on a terminal: a live progress bar (step, loss, tokens/s, ETA) instead of one
line per step. (Not on a terminal, the plain lines stay: see test_tracking.py.)"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import kill_tree, meshrun_env, tiny

STEPS = 3
pytestmark = pytest.mark.timeout(900)  # one process, ~20 s idle; much longer on a shared machine


def run_on_terminal(args: list[str], *, tmp_path: Path, timeout: float = 600) -> str:
    """`python -m meshrun ARGS` with stdout and stderr on a pseudo-terminal; what it displayed."""
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns, as a real one
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrun", *args],
        cwd=tmp_path,
        env=meshrun_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
    )
    os.close(terminal)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal has exited
                    break
                if not chunk:
                    break
                shown += chunk
        else:
            kill_tree(proc.pid)
            pytest.fail(f"meshrun on a terminal timed out after {timeout}s:\n{shown.decode(errors='replace')[-3000:]}")
    finally:
        os.close(master)
    assert proc.wait(timeout=30) == 0, shown.decode(errors="replace")[-3000:]
    return shown.decode(errors="replace")


def test_terminal_shows_a_live_bar_with_loss_throughput_and_eta(data_dir: Path, tmp_path: Path) -> None:
    settings = {"train.steps": STEPS, "train.eval_interval": STEPS}
    shown = run_on_terminal(["train", *tiny(data_dir, tmp_path / "run", **settings)], tmp_path=tmp_path)
    frames = re.findall(
        rf"\[meshrun\] step (\d)/{STEPS} \|[^|]*\| ETA [0-9:?]+(, loss [0-9.]+, [0-9.]+k tok/s)?", shown
    )
    drawn = [int(step) for step, postfix in frames if postfix]
    assert list(dict.fromkeys(drawn)) == list(range(1, STEPS + 1)), shown  # redrawn after each step, in order
    assert "\r" in shown  # drawn over itself, not one line per step
    assert not re.search(r"\[meshrun\] step \d/\d \| loss", shown)  # the log-file lines are replaced
    assert f"[meshrun] step {STEPS}/{STEPS} | val loss" in shown  # other messages still appear, above the bar
    assert "[meshrun] summary" in shown
