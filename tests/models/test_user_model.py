"""A model defined outside the package trains through `model.factory`, and splits into stages."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import final_weights, losses, max_weight_diff, meshrun_env, run_meshrun, tiny

HERE = Path(__file__).parent
USER = {
    "model.factory": "toy_lm:build",
    "model.options": "{kernel: 4}",
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
}


def train(data_dir: Path, run: Path, **overrides: object) -> Path:
    run_meshrun(
        ["train", *tiny(data_dir, run, **{**USER, **overrides})],
        tmp_path=run.parent,
        env=meshrun_env(run.parent, PYTHONPATH=str(HERE)),
    )
    return run


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(data_dir, tmp_path_factory.mktemp("ref") / "run")  # one process, 4 micro-steps of 2


@pytest.mark.parametrize(
    "overrides", [{"parallel.dp": 2}, {"parallel.pp": 2, "recompute": "every:2"}], ids=["dp2", "pp2-recompute"]
)
def test_user_model_matches_one_process(overrides, reference: Path, data_dir: Path, tmp_path: Path) -> None:
    run = train(data_dir, tmp_path / "run", **overrides)
    weights = final_weights(run)
    assert "blocks.3.mix.weight" in weights and "embed.weight" in weights  # the user's model, not GPT
    assert max_weight_diff(weights, final_weights(reference)) < 1e-5
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)
