"""causal_lm and seq2seq: token windows, pairs or mixtures (data/dataset.py, data/pairs.py); the loss
is the token cross-entropy; validation reports the loss alone."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshrun.data.dataset import open_dataset
from meshrun.models.families import source_len
from meshrun.tasks import Batches, Task
from meshrun.training.loss import token_cross_entropy

if TYPE_CHECKING:
    from meshrun.config.schema import Config


def open_split(cfg: Config, data_dir: Path, split: str) -> Batches:
    """The configured data (one folder, or a mixture), batched as the model's family reads it: an
    encoder-decoder's share of the sample, the samples that share a length bucket."""
    return open_dataset(
        cfg.data,
        data_dir,
        split,
        seq_len=cfg.model.seq_len,
        seed=cfg.train.seed,
        source_len=source_len(cfg.model),
        global_batch=cfg.train.global_batch,
    )


class LossOnly:
    """Validation's meter: the token loss, nothing else counted."""

    def summed(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(output, targets)

    def counts(self) -> list[float]:
        return []

    def figures(self, counts: list[float]) -> dict[str, float]:
        return {}


def check_data(cfg: Config, data_dir: Path) -> None:
    from meshrun.preflight import check_token_data

    check_token_data(cfg, data_dir)


TASK = Task(
    "tokens",
    open_split=open_split,
    summed=token_cross_entropy,
    meter=lambda cfg, device: LossOnly(),
    check_data=check_data,
)
