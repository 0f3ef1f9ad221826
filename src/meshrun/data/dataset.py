"""Deterministic batches from a token memmap, addressed by global sample index.

Sample `i` of the stream is the window starting at `hash(seed, i)`: the data a step sees
depends only on the step and the global batch, never on how ranks split it. Resuming or
changing dp therefore needs only the number of global samples consumed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshrun.errors import ConfigError
from meshrun.data.prepare import SPLITS

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


class TokenDataset:
    """Read-only view of one split; `batch(first, count)` returns inputs and next-token targets."""

    def __init__(self, data_dir: str | Path, split: str, *, seq_len: int, seed: int) -> None:
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise ConfigError(f"data.dir {data_dir} has no {path.name}; run `meshrun prepare-data --out {data_dir}`")
        num_tokens = path.stat().st_size  # uint8 tokens; checked first because an empty file cannot be mapped
        if num_tokens < seq_len + 1:
            raise ConfigError(
                f"{path} holds {num_tokens} tokens, fewer than model.seq_len + 1 = {seq_len + 1}; "
                "prepare more text or lower model.seq_len"
            )
        self.tokens = np.memmap(path, dtype=np.uint8, mode="r")  # read-only: the dataset is never written
        self.seq_len = seq_len
        self.num_starts = len(self.tokens) - seq_len
        self.salt = np.uint64((seed * 2 + SPLITS.index(split)) & 0xFFFFFFFF) << np.uint64(32)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first+count-1 of the stream as (x, y), each (count, seq_len) int64."""
        index = np.arange(first, first + count, dtype=np.uint64)
        starts = (_splitmix64(index ^ self.salt) % np.uint64(self.num_starts)).astype(np.int64)
        windows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        window = torch.from_numpy(windows)
        return window[:, :-1], window[:, 1:]


def check_data_dir(data_dir: str | Path, seq_len: int) -> None:
    """Fail early (before spawning) on missing, empty or too-small data."""
    for split in SPLITS:
        TokenDataset(data_dir, split, seq_len=seq_len, seed=0)
