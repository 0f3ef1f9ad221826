"""dp x pp numerics: every layout, schedule and recompute policy equals one process.

Each row runs the real CLI under torchrun (gloo, CPU) and compares the final checkpoint's
weights, loaded on one process, with a single-process run on the same global batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import final_weights, losses, max_weight_diff, read_metrics, run_meshrun, tiny

HERE = Path(__file__).parent
# 8 blocks so pp=4 x 2 virtual stages fits; lr/clip chosen so clipping is active every step.
BASE = {"model.num_layers": 8, "train.global_batch": 16, "train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5}


def train(data_dir: Path, run: Path, **overrides: object) -> Path:
    run_meshrun(["train", *tiny(data_dir, run, **{**BASE, **overrides})], tmp_path=run.parent)
    return run


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process taking the whole global batch of 16 in a single micro-step."""
    return train(data_dir, tmp_path_factory.mktemp("ref") / "run", **{"train.micro_batch": 16})


MATRIX = [  # dp, pp, schedule, recompute; micro_batch 2 -> accumulation 8 / dp
    (1, 2, "gpipe", "none"),
    (1, 2, "1f1b", "full"),
    (1, 2, "interleaved-1f1b", "every:2"),
    (1, 4, "gpipe", "every:2"),
    (1, 4, "1f1b", "none"),
    (1, 4, "interleaved-1f1b", "full"),
    (2, 2, "gpipe", "full"),
    (2, 2, "1f1b", "none"),
    (2, 2, "interleaved-1f1b", "selective"),
    (2, 4, "gpipe", "none"),
    (2, 4, "1f1b", "every:2"),
    (2, 4, "interleaved-1f1b", "none"),
]


@pytest.mark.parametrize("dp,pp,schedule,recompute", MATRIX, ids=lambda v: str(v))
def test_layout_matches_one_process(dp, pp, schedule, recompute, reference: Path, data_dir: Path, tmp_path: Path) -> None:
    run = train(
        data_dir, tmp_path / "run",
        **{"parallel.dp": dp, "parallel.pp": pp, "parallel.schedule": schedule, "recompute": recompute},
    )
    rows = [row for row in read_metrics(run) if "grad_norm" in row]
    assert min(row["grad_norm"] for row in rows) > 0.5, "clipping must be active for the test to mean anything"
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-5
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)
