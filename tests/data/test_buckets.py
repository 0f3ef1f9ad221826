"""Length buckets for pairs data: every global batch comes from one bucket, padded to its length;
the sequence of batches is a function of the global sample index alone (any dp split, resume)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from meshrun.config.schema import DataConfig
from meshrun.data.dataset import check_data
from meshrun.data.pairs import BOS, PairsDataset
from meshrun.data.storage import IGNORE, read_meta
from meshrun.errors import ConfigError

GLOBAL_BATCH = 8
LAYOUT = {"seq_len": 80, "seed": 3, "source_len": 40, "global_batch": GLOBAL_BATCH}


def dataset(lopsided_dir: Path, **overrides: object) -> PairsDataset:
    settings = {**LAYOUT, "buckets": [20, 40], **overrides}
    return PairsDataset(lopsided_dir, "train", read_meta(lopsided_dir), **settings)  # type: ignore[arg-type]


def test_each_global_batch_is_one_bucket_padded_to_its_length(lopsided_dir: Path) -> None:
    data = dataset(lopsided_dir)
    widths = []
    for step in range(30):
        x, y = data.batch(step * GLOBAL_BATCH, GLOBAL_BATCH)
        width, source = x.shape[1], x.shape[1] - y.shape[1]
        assert source * 80 == width * 40  # the source keeps its share of the sample
        assert (x[:, source] == BOS).all()  # every target starts right after the bucket's source
        which = data.pairs(step * GLOBAL_BATCH, GLOBAL_BATCH)
        needs = np.maximum(2 * data.source.lengths[which], 2 * (data.target.lengths[which] + 1))  # S = T = L / 2
        home = [min([n for n in (20, 40, 80) if n >= need] or [80]) for need in needs]
        assert home == [width] * GLOBAL_BATCH  # all pairs are of this bucket, the shortest that holds them
        assert data.target_tokens(step * GLOBAL_BATCH, GLOBAL_BATCH) == int((y != IGNORE).sum())
        widths.append(width)
    assert set(widths) == {20, 40, 80}, widths  # the buckets all occur, and batches change length


def test_dp_slices_and_a_reopened_dataset_give_the_same_batches(lopsided_dir: Path) -> None:
    """Ranks read slices of the global batch at global sample offsets; a resumed run opens the
    data afresh at its checkpointed sample count: both see exactly the one-process batches."""
    data = dataset(lopsided_dir)
    for dp in (2, 4):
        for step in (0, 5):
            whole = data.batch(step * GLOBAL_BATCH, GLOBAL_BATCH)
            per_rank = GLOBAL_BATCH // dp
            slices = [data.batch(step * GLOBAL_BATCH + r * per_rank, per_rank) for r in range(dp)]
            for part in (0, 1):
                assert torch.equal(torch.cat([s[part] for s in slices]), whole[part])
    resumed = dataset(lopsided_dir)
    for step in range(6, 12):
        a, b = data.batch(step * GLOBAL_BATCH, GLOBAL_BATCH), resumed.batch(step * GLOBAL_BATCH, GLOBAL_BATCH)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="cross a global batch"):
        data.batch(GLOBAL_BATCH - 2, 4)


def test_buckets_save_padding_and_no_buckets_is_unchanged(lopsided_dir: Path) -> None:
    bucketed, plain = dataset(lopsided_dir), dataset(lopsided_dir, buckets=[])
    padded = [sum(d.batch(s * GLOBAL_BATCH, GLOBAL_BATCH)[0].numel() for s in range(50)) for d in (bucketed, plain)]
    assert padded[0] < 0.7 * padded[1], padded  # 0.62 on this data
    old = np.arange(16, dtype=np.uint64)  # without buckets: pair hash(i) mod num_pairs, as before buckets
    from meshrun.data.hashing import splitmix64

    expected = (splitmix64(old ^ plain.salt) % np.uint64(plain.num_pairs)).astype(np.int64)
    assert plain.pairs(0, 16).tolist() == expected.tolist()


@pytest.mark.parametrize(
    "buckets,source_len,message",
    [
        ([25], 40, r"data.buckets \[25\] do not split .* use multiples of 2"),
        ([90], None, "must lie in 2 .. model.seq_len"),
    ],
)
def test_buckets_that_do_not_fit_are_refused(lopsided_dir: Path, buckets, source_len, message) -> None:
    with pytest.raises(ConfigError, match=message):
        dataset(lopsided_dir, buckets=buckets, source_len=source_len, seq_len=80)


def test_buckets_on_token_windows_are_refused(data_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.buckets needs pairs data"):
        check_data(DataConfig(dir=str(data_dir), buckets=[8]), data_dir, seq_len=16, model_vocab_size=256)
