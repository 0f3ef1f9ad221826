"""Dropout under tensor parallelism (parallel/tp_rng.py), tp2 on gloo, real torchrun: masks equal
where the tp ranks hold the same activations and different where each holds its own part
(tp_masks_gpt.py checks them every step), and recompute reruns the masks its first forward drew."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import grad_norms, losses, meshrun_env, run_meshrun, tiny

DROPOUT = {"model.dropout": 0.1, "parallel.tp": 2, "train.steps": 2}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_masks_differ_where_tp_ranks_hold_different_activations(
    sequence_parallel: bool, data_dir: Path, tmp_path: Path
) -> None:
    """Attention's masks differ over the ranks' heads; the residual stream's are equal (replicated),
    and under sequence parallel differ (a rank's positions). A shared stream fails the first; a
    stream per rank everywhere fails the second (the hidden states drift apart)."""
    keys = {**DROPOUT, "model.factory": "tp_masks_gpt:build", "parallel.sequence_parallel": sequence_parallel}
    env = meshrun_env(tmp_path, PYTHONPATH=str(Path(__file__).parent))
    run_meshrun(["train", *tiny(data_dir, tmp_path / "run", **keys)], tmp_path=tmp_path, env=env, timeout=240)


def train(data_dir: Path, run: Path, **overrides: object) -> Path:
    run_meshrun(["train", *tiny(data_dir, run, **DROPOUT, **overrides)], tmp_path=run.parent, timeout=240)
    return run


@pytest.fixture(scope="module")
def without_recompute(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """tp2 with dropout and no recompute, with and without sequence parallel."""
    tmp = tmp_path_factory.mktemp("no_recompute")
    return {sp: train(data_dir, tmp / f"sp{sp}", **{"parallel.sequence_parallel": sp}) for sp in (False, True)}


@pytest.mark.parametrize(
    "recompute,sequence_parallel", [("full", False), ("selective", False), ("full", True), ("selective", True)]
)
def test_recompute_reruns_the_same_masks(
    recompute: str, sequence_parallel: bool, without_recompute: dict[bool, Path], data_dir: Path, tmp_path: Path
) -> None:
    """Recompute's rerun draws the masks the first forward drew, in the shared and the rank streams:
    a different mask in the rerun gives the step's gradients of another forward (grad norm off)."""
    run = train(data_dir, tmp_path / "run", recompute=recompute, **{"parallel.sequence_parallel": sequence_parallel})
    reference = without_recompute[sequence_parallel]
    assert losses(run) == pytest.approx(losses(reference), rel=1e-6)
    assert grad_norms(run) == pytest.approx(grad_norms(reference), rel=1e-6)
