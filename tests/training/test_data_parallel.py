"""DDP x accumulation numerics: any split of the global batch equals one process on it, and
that one process equals an independent plain-torch computation (tests/plain_reference.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import final_weights, grad_norms, losses, max_weight_diff, run_meshrun, tiny, train_job
from plain_reference import assert_grad_norms_match

# lr high enough and clip low enough that clipping is active on every step.
STEPS = dict(**{"train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5})


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process on the same global batch of 8 (4 micro-steps of 2; the dp run does 2 per rank)."""
    tmp = tmp_path_factory.mktemp("ref")
    train_job(tiny(data_dir, tmp / "run", **STEPS), tmp_path=tmp)
    return tmp / "run"


def test_one_process_matches_plain_torch(reference: Path, plain_reference) -> None:
    """Mean token cross-entropy over the whole global batch, one backward, torch's AdamW and
    clip_grad_norm_: a wrong constant factor in meshrun's gradient fails the grad-norm checks."""
    plain = plain_reference(**STEPS)
    assert losses(reference)[0] == pytest.approx(plain.losses[0], rel=1e-5)
    assert_grad_norms_match(grad_norms(reference), plain.grad_norms)
    assert min(plain.grad_norms) > 0.5, "clipping must be active on every step for this test to mean anything"
    assert max_weight_diff(final_weights(reference), plain.weights) < 1e-5


def test_dp2_with_accumulation_matches_one_process(
    reference: Path, data_dir: Path, tmp_path: Path, plain_reference
) -> None:
    run_meshrun(
        ["train", *tiny(data_dir, tmp_path / "run", **STEPS, **{"parallel.dp": 2, "train.micro_batch": 2})],
        tmp_path=tmp_path,
    )
    run = tmp_path / "run"
    assert min(grad_norms(run)) > 0.5, "clipping must be active on every step for this test to mean anything"
    assert_grad_norms_match(grad_norms(run), plain_reference(**STEPS).grad_norms)
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-5
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)
