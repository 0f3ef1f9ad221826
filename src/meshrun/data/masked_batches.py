"""Batches of a masked_lm folder (`meshrun prepare-data --task masked_lm`): token windows drawn as
causal_lm draws them (data/dataset.py: window `i` starts at hash(seed, i)), masked by
data/masking.py with the job's seed and each window's GLOBAL sample index, so every layout, rank
and resumed run feeds sample `i` with the same positions masked. x = the masked inputs (B, T),
y = the original token at each chosen position and IGNORE elsewhere (B, T).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshrun.data.dataset import TokenDataset
from meshrun.data.masking import MaskingRule, mask_tokens, rule_of
from meshrun.data.storage import IGNORE, read_meta
from meshrun.errors import ConfigError


class MaskedWindows:
    """Masked token windows of one split; a batch's targets are its chosen positions."""

    def __init__(self, data_dir: str | Path, split: str, *, seq_len: int, seed: int, rate: float) -> None:
        folder = Path(data_dir)
        meta = read_meta(folder) or {}
        if meta.get("task") != "masked_lm":
            raise ConfigError(
                f"{folder} holds {meta.get('task', meta.get('format', 'no prepared'))} data, with no mask token: "
                f"prepare it with `meshrun prepare-data --task masked_lm --source ... --out DIR` and set data.dir: DIR"
            )
        self.rule: MaskingRule = rule_of(meta, rate)
        self.windows = TokenDataset(folder, split, seq_len=seq_len, seed=seed)
        self.vocab_size, self.files, self.where = self.windows.vocab_size, self.windows.files, self.windows.where
        self.seed = seed

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first+count-1 as (masked inputs, targets), each (count, seq_len) int64."""
        tokens = self.windows.batch(first, count)[0].numpy()
        inputs, targets = mask_tokens(tokens, np.arange(first, first + count), seed=self.seed, rule=self.rule)
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def target_tokens(self, first: int, count: int) -> int:
        """The loss's divisor: the chosen positions of those samples (masked again here: a pure function)."""
        return int((self.batch(first, count)[1] != IGNORE).sum())

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        return {}
