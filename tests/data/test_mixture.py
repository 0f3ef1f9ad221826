"""data.mixture: shares by weight, each sample a pure function of its global index, and a run
resumed with another dp continues the same data and weights; per-source counts in metrics."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WORDS, final_weights, losses, max_weight_diff, read_metrics, run_meshrun, tiny
from test_checkpoint import interrupted_copy

from meshrun.config.schema import load_config
from meshrun.data.dataset import MixtureDataset, TokenDataset
from meshrun.data.prepare import prepare
from meshrun.errors import ConfigError


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second byte-level dataset with other text (reversed words: other windows)."""
    rng, corpus = random.Random(5), tmp_path_factory.mktemp("other-corpus")
    for i in range(10):
        (corpus / f"t{i}.txt").write_text(
            "\n".join(" ".join(rng.choice(WORDS)[::-1] for _ in range(9)) for _ in range(60))
        )
    out = tmp_path_factory.mktemp("other") / "other"
    prepare([str(corpus)], out, val_fraction=0.2, progress=False)
    return out


def mixture(dirs: list[Path], weights: list[float], split: str = "train") -> MixtureDataset:
    parts = [TokenDataset(d, split, seq_len=16, seed=3 + k) for k, d in enumerate(dirs)]
    return MixtureDataset(parts, weights, [f"s{k}" for k in range(len(dirs))])


@pytest.mark.parametrize(
    "weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1.0, 9.0], [1e308, 1e308], [1e308, 1e-300, 1e308], [5e-324, 5e-324]]
)
def test_shares_follow_the_weights(weights: list[float], data_dir: Path, other_data: Path) -> None:
    """Weights whose sum overflows (1e308 each) or that are tiny share as any others."""
    mix = mixture([data_dir, other_data, data_dir][: len(weights)], weights)
    expected = np.array(weights) / max(weights)
    for first in (0, 123_456_789):
        counts = mix.source_counts(first, 2000)
        shares = np.array(list(counts.values())) / 2000
        assert np.abs(shares - expected / expected.sum()).max() <= 0.02, shares


@pytest.mark.parametrize("weight", ["0", "-1", "inf", ".nan", "1e309"])
def test_weights_that_share_nothing_are_refused(weight: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid data\.mixture\[1\]\.weight"):
        load_config(None, [f"data.mixture=[{{dir: a, weight: 1}}, {{dir: b, weight: {weight}}}]"])


def test_samples_are_a_function_of_the_global_index(data_dir: Path, other_data: Path) -> None:
    mix = mixture([data_dir, other_data], [0.7, 0.3])
    x, y = mix.batch(40, 16)
    for cut in (1, 5, 11):  # however ranks split a global batch, each sees the same rows
        x1, y1 = mix.batch(40, cut)
        x2, y2 = mix.batch(40 + cut, 16 - cut)
        assert torch.equal(torch.cat([x1, x2]), x) and torch.equal(torch.cat([y1, y2]), y)
    index = np.arange(40, 56, dtype=np.uint64)
    source = mix.sources(index)
    assert set(source.tolist()) == {0, 1}
    for k, part in enumerate(mix.parts):  # sample i of the mixture is sample i of its source
        xs, ys = part.windows(index[source == k])
        assert torch.equal(x[torch.from_numpy(source == k)], xs) and torch.equal(y[torch.from_numpy(source == k)], ys)
    assert torch.equal(x[:, 1:], y[:, :-1])


def _mixture_args(data_dir: Path, other_data: Path, run: Path, **overrides: object) -> list[str]:
    spec = f"[{{dir: {data_dir}, weight: 0.7}}, {{dir: {other_data}, weight: 0.3}}]"
    settings = {
        "data.dir": "null",
        "data.mixture": spec,
        "train.steps": 8,
        "checkpoint.interval": 4,
        "train.lr": 3e-3,
        **overrides,
    }
    return ["train", *tiny(data_dir, run, **settings)]


def test_resume_with_another_dp_continues_the_mixture(data_dir: Path, other_data: Path, tmp_path: Path) -> None:
    """Written by dp2, interrupted after step 4, resumed by one process: same samples per
    source at every step, same losses and weights (to fp32 reduction order)."""
    full = tmp_path / "full"
    run_meshrun(_mixture_args(data_dir, other_data, full, **{"parallel.dp": 2}), tmp_path=tmp_path)
    run = interrupted_copy(full, tmp_path / "run", at_step=4)
    result = run_meshrun(_mixture_args(data_dir, other_data, run, **{"parallel.dp": 1}), tmp_path=tmp_path)
    assert "resumed from" in result.stderr and "step 4" in result.stderr
    counts = [{k: v for k, v in row.items() if k.startswith("samples/")} for row in read_metrics(full) if "loss" in row]
    assert counts == [
        {k: v for k, v in row.items() if k.startswith("samples/")} for row in read_metrics(run) if "loss" in row
    ]
    assert list(counts[-1]) == [f"samples/{data_dir.name}", f"samples/{other_data.name}"]
    assert sum(counts[-1].values()) == 8 * 8 and counts[-1][f"samples/{data_dir.name}"] == pytest.approx(
        0.7 * 64, abs=2
    )
    assert losses(run) == pytest.approx(losses(full), abs=1e-5)
    assert max_weight_diff(final_weights(run), final_weights(full)) < 1e-5
