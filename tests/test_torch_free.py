"""The torch-free fast path: the modules every refusal before a worker needs import no torch, so a
mistake is one line in well under a second (importing torch costs seconds on a loaded 2-core machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = (
    "meshrun.cli",
    "meshrun.config",
    "meshrun.checkpoint.paths",
    "meshrun.models.hf_config",
    "meshrun.preflight",
    "meshrun.parallel.layout",
    "meshrun.parallel.stages",
    "meshrun.planner.model_size",
    "meshrun.data.locations",
    "meshrun.data.labelled",  # prepare-data --task classification / regression / masked_lm
    "meshrun.data.series",
    "meshrun.data.masking",
    "meshrun.versions",
    "meshrun.launcher.keeper",  # a process per rank beside its worker: no torch's seconds and memory in it
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_check_can_fail() -> None:
    code = "import sys, meshrun.parallel.mesh; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "torch was imported" in done.stderr
