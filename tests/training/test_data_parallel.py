"""DDP x accumulation numerics: any split of the global batch equals one process on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import final_weights, losses, max_weight_diff, read_metrics, run_meshrun, tiny

# lr high enough and clip low enough that clipping is active on every step.
STEPS = dict(**{"train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5})


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process on the same global batch of 8 (4 micro-steps of 2; the dp run does 2 per rank)."""
    tmp = tmp_path_factory.mktemp("ref")
    run_meshrun(["train", *tiny(data_dir, tmp / "run", **STEPS)], tmp_path=tmp)
    return tmp / "run"


def test_dp2_with_accumulation_matches_one_process(reference: Path, data_dir: Path, tmp_path: Path) -> None:
    run_meshrun(["train", *tiny(data_dir, tmp_path / "run", **STEPS, **{"parallel.dp": 2, "train.micro_batch": 2})], tmp_path=tmp_path)
    run = tmp_path / "run"
    grad_norms = [row["grad_norm"] for row in read_metrics(run) if "grad_norm" in row]
    assert min(grad_norms) > 0.5, "clipping must be active on every step for this test to mean anything"
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-5
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)
