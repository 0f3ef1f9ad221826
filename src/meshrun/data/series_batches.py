"""Batches of a regression folder (data/series.py writes it): x = a window's model.seq_len past
values (B, seq_len, features), y = the last of them and the `horizon` values after them (B,
1 + horizon, features), all standardised. A training sample `i` is window hash(seed, i) mod windows, as labelled rows are
drawn; a validation sample `i` is window i mod windows, so validation reads the tail of each series
in order. A batch's targets are its values: the loss sums a per-value loss, divided by the global
batch's count of predicted values, so every layout computes the same gradient.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshrun.data.hashing import drawn_rows, split_salt
from meshrun.data.series import Windows
from meshrun.data.storage import SPLITS, read_meta
from meshrun.errors import ConfigError


class SeriesDataset:
    """(past values, future values) batches of one split of a regression folder."""

    def __init__(self, data_dir: str | Path, split: str, *, seq_len: int, horizon: int, seed: int) -> None:
        folder = Path(data_dir)
        self.meta = read_meta(folder) or {}
        if self.meta.get("format") != "regression":
            raise ConfigError(
                f"{folder} holds {self.meta.get('format', 'no prepared')} data, not regression data; prepare it with "
                f"`meshrun prepare-data --task regression --seq-len {seq_len} --horizon {horizon} --out DIR` "
                "and set data.dir: DIR"
            )
        self.windows = Windows(folder, split, self.meta, seq_len=seq_len, horizon=horizon)
        self.features = self.windows.values.shape[1]
        self.in_order, self.where = split == "val", f"{folder} ({split})"
        self.salt = split_salt(seed, SPLITS.index(split))

    def indices(self, first: int, count: int) -> np.ndarray:
        """Window numbers of samples first .. first+count-1."""
        return drawn_rows(first, count, len(self.windows), salt=self.salt, in_order=self.in_order)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first+count-1 as x (count, seq_len, features) and y (count, 1 + horizon,
        features), float32: y's first step is the last past value (tasks/regression.py scores the
        naive forecast with it), the rest the values to predict."""
        pairs = [self.windows.window(k) for k in self.indices(first, count)]
        x = np.stack([past for past, _ in pairs]).astype(np.float32)
        y = np.stack([np.concatenate([past[-1:], future]) for past, future in pairs]).astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(y)

    def positions_per_sample(self, x: torch.Tensor) -> int:
        """A window's time steps (x is (B, T, features)): what tokens/s and MFU count."""
        return x.shape[1]

    def target_tokens(self, first: int, count: int) -> int:
        """The loss's divisor: the values the samples predict (horizon x features each)."""
        return count * self.windows.horizon * self.features

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        return {}
