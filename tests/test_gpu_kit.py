"""bench/gpu.py, the one-command GPU kit, must not rot on machines without a GPU: `--smoke` runs
its code paths (checks, host-sync bench, the Llama MFU runs eager and compiled, with LoRA compiled, the MoE runs, planner memory,
offload at a long sequence, the report) on the CPU with tiny models, and every check in it must pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshrun_env

KIT = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


@pytest.mark.timeout(900)
def test_the_gpu_kit_smoke_run_passes_and_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    env = meshrun_env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="2")
    done = subprocess.run(
        [sys.executable, str(KIT), "--smoke", "--out", str(report)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    for section in ("## Checks", "## Host syncs", "## MFU", "## Planner memory", "## MoE", "## Long context"):
        assert section in text
    checks = [line for line in text.splitlines() if line.startswith("| ") and ("PASS" in line or "FAIL" in line)]
    assert len(checks) == 7 and all("| PASS |" in line for line in checks), checks  # 6 + long context's
    for run in ("eager-none", "compiled-none", "eager-selective", "compiled-selective"):
        assert text.count(f"| llama-{run} mb") == 2  # its MFU row and its memory row
    assert text.count("| llama-lora-r16-compiled-none mb") == 2  # LoRA: its MFU row and its memory row
    for run in ("moe-gpt-16x-top2", "qwen3-moe-64x-top8"):
        assert text.count(f"| {run} mb") == 2  # MoE: its MFU row and its memory row
