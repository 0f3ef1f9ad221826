"""causal_lm and seq2seq: token windows, pairs or mixtures (data/dataset.py, data/pairs.py); the loss
is the token cross-entropy; validation reports the loss alone."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from meshrun.data.dataset import check_data, open_dataset
from meshrun.data.storage import IGNORE
from meshrun.models.families import source_len
from meshrun.models.hf_config import hf_dir, is_hf, model_tokenizer, vocab_key, vocab_size
from meshrun.models.hf_weights import has_weights
from meshrun.tasks import Batches, Task

if TYPE_CHECKING:
    from meshrun.config.schema import Config


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropies of logits (B, T, V) against targets (B, T), `IGNORE` left out."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


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


def check_token_data(cfg: Config, path: Path) -> None:
    """The data parses, holds enough tokens for a sample, its ids fit the model's vocabulary, and
    it was tokenized with the model folder's tokenizer when both have one."""
    model_dir = hf_dir(cfg.model)
    check_data(
        cfg.data,
        path,
        seq_len=cfg.model.seq_len,
        model_vocab_size=vocab_size(cfg.model),
        vocab_key=vocab_key(cfg.model),
        model_tokenizer=model_tokenizer(model_dir),
        pretrained=is_hf(cfg.model) and model_dir is not None and cfg.model.init != "random" and has_weights(model_dir),
        source_len=source_len(cfg.model),
    )


TASK = Task(
    "tokens",
    open_split=open_split,
    summed=lambda cfg: token_cross_entropy,
    meter=lambda cfg, device: LossOnly(),
    check_data=check_token_data,
)
