"""masked_lm: encoder pretraining on masked tokens (BERT / RoBERTa / ESM). A batch is token windows
whose chosen positions (task_options.mask_rate of the non-special tokens; of those 80% become the
mask token, 10% a random token, 10% stay) are a pure function of the job's seed and the global
sample index (data/masked_batches.py, data/masking.py): every layout masks the same tokens. The
last stage's output is (B, T, vocab) logits (the encoder's tokens head, models/encoder.py); the
loss sums the cross-entropies at the chosen positions, which the normalisation divides by the
global batch's count of them (the data's `target_tokens`). Validation: the loss, the masked-token
accuracy (the argmax is the original token), the perplexity exp(loss), and beside them the accuracy
of always guessing the most frequent token among those positions (the baseline a model must beat).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from meshrun.data.dataset import check_vocab
from meshrun.data.masked_batches import MaskedWindows
from meshrun.data.storage import IGNORE, SPLITS
from meshrun.data.token_ids import check_token_files
from meshrun.errors import ConfigError
from meshrun.tasks import Task
from meshrun.tasks.tokens import token_cross_entropy

if TYPE_CHECKING:
    from meshrun.config.schema import Config


def open_split(cfg: Config, data_dir: Path, split: str) -> MaskedWindows:
    seq_len, seed, rate = cfg.model.seq_len, cfg.train.seed, cfg.task_options.mask_rate
    return MaskedWindows(data_dir, split, seq_len=seq_len, seed=seed, rate=rate)


class MaskedAccuracy:
    """Validation's meter, on the device: the summed loss, the chosen positions predicted right, and
    how often each token is the target (their sum: the count of chosen positions)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, hits
        self.tally = torch.zeros(vocab_size, dtype=torch.float64, device=device)

    def summed(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss, chosen = token_cross_entropy(output, targets), targets != IGNORE
        hits = ((output.argmax(-1) == targets) & chosen).sum()
        self.sums += torch.stack([loss.detach().double(), hits.double()])
        self.tally += torch.bincount(targets[chosen], minlength=len(self.tally)).double()
        return loss

    def counts(self) -> list[float]:
        return [*self.sums.tolist(), *self.tally.tolist()]

    def figures(self, counts: list[float]) -> dict[str, float]:
        loss, hits, tally = counts[0], counts[1], counts[2:]
        n = max(sum(tally), 1.0)
        return {
            "accuracy": hits / n,
            "majority_accuracy": max(tally) / n,  # always the most frequent target token
            "perplexity": math.exp(min(loss / n, 700.0)),  # 700: below float64's overflow
        }


def check_data(cfg: Config, data_dir: Path) -> None:
    """The folder holds masked_lm data (a mask token and special ids in meta.json) whose windows fit
    model.seq_len and whose ids, the mask's included, fit model.vocab_size."""
    if cfg.data.mixture or cfg.data.format != "meshrun":
        raise ConfigError(
            "task masked_lm reads a folder `meshrun prepare-data --task masked_lm` wrote: remove data.mixture / data.format"
        )
    for split in SPLITS:
        data = open_split(cfg, data_dir, split)
        check_vocab(data.vocab_size, cfg.model.vocab_size, data.where)
        check_token_files(data.files, vocab_size=data.vocab_size, model_vocab_size=cfg.model.vocab_size)


TASK = Task(
    "masked_lm",
    open_split=open_split,
    summed=lambda cfg: token_cross_entropy,
    meter=lambda cfg, device: MaskedAccuracy(cfg.model.vocab_size, device),
    check_data=check_data,
)
