"""Every bench in bench/ must keep running: its `--quick` mode (tiny sizes, one round) goes through
the bench's code paths in seconds, and here each one runs as a subprocess and must exit 0 having
printed its verdict or ratio line. (bench/pipeline.py once stopped running unseen for weeks.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshrun_env

BENCH = Path(__file__).resolve().parents[1] / "bench"
VERDICTS = {  # bench -> a line its quick run must print (its verdict or its ratio)
    "overhead.py": r"^(PASS|FAIL): meshrun/hand median [\d.]+x",
    "host_sync.py": r"^fp32: (PASS|NOT CHECKED), 2 steps",
    "roofline.py": r"^(PASS|FAIL): targets meshrun/hand",
    "data.py": r"^tokenization: .* prepare-data / raw = [\d.]+x",
    "hf.py": r"^(PASS|FAIL): worst stage peak / its share [\d.]+x",
    "fsdp.py": r"^fsdp / ddp step time: median ratio [\d.]+",
    "tp.py": r"^step time tp2 / tp1: median [\d.]+",
    "buckets.py": r"^bucketed / padded step time: median [\d.]+x",
    "plan.py": r"^ranking: pairs ordered alike.*: (PASS|FAIL)$",
    "pipeline.py": r"^summary: \d/3 targets met",
    "checkpoint.py": r"^(PASS|FAIL): async/sync blocked median [\d.]+x",
    "packing.py": r"^(PASS|FAIL): best-fit decreasing fills at least as well",
    "lora.py": r"^(PASS|FAIL): trainable state per rank lora / full [\d.]+%",
    "packed_attention.py": r"^best document-masked way / nomask at the longest seq: [\d.]+x",
    "sft.py": r"^(PASS|FAIL): packed / padded trained tokens/s [\d.]+x",
    "tasks.py": r"^(PASS|FAIL): every task's meshrun/hand median <= [\d.]+x",
    "recovery.py": r"^(PASS|FAIL): SIGKILL -> state copied [\d.]+ s with a spare",
    "moe.py": r"^(PASS|FAIL): ep2 / ep1 state [\d.]+, planner / measured [\d.]+",
    "context.py": r"^(PASS|FAIL): peak activations per rank cp2 / cp1 [\d.]+x",
    "startup.py": r"^(PASS|FAIL): forked / spawned launch wall time median [\d.]+x",
}
ELSEWHERE = {"gpu.py": "tests/test_gpu_kit.py runs `--smoke`"}  # its quick mode, already tested
TIMEOUT = 240  # seconds per bench; each takes 5-40 s of CPU


def test_every_bench_is_run_here_or_elsewhere() -> None:
    benches = {path.name for path in BENCH.glob("*.py") if not path.name.startswith("_")}
    assert benches == set(VERDICTS) | set(ELSEWHERE)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("bench", sorted(VERDICTS))
def test_quick_mode_runs_and_prints_its_verdict(bench: str, tmp_path: Path) -> None:
    env = meshrun_env(tmp_path, TMPDIR=str(tmp_path), WANDB_MODE="disabled")
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / bench), "--quick"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout takes its torchrun workers too
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert re.search(VERDICTS[bench], out, re.MULTILINE), out[-4000:]
    assert "quick run: tiny sizes, its numbers are not measurements" in out, out[-4000:]
