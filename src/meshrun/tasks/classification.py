"""classification: a text -> one of the data's labels (data/labelled.py prepares it). A batch is
(token ids padded with PAD, label ids); the last stage's output is (B, num_labels) logits (the
encoder's head, models/encoder.py); the loss sums the samples' cross-entropies, which the
normalisation divides by the global batch's sample count (the data's `target_tokens`), so every
layout computes the same gradient. With task_options.class_weights each sample's cross-entropy
counts its label's weight and the normalisation divides by the global batch's summed weights
instead (`bind`, `Task.divisor`): torch's `F.cross_entropy(weight=...)` over the whole batch.
Validation: the loss (weighted as training's), accuracy and macro F1 (the unweighted mean over
labels of each label's F1; a label with no sample and no prediction is left out).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.model_sections import EncoderSection, HFSection
from meshrun.data.dataset import check_vocab
from meshrun.data.labelled_batches import PAD, LabelledDataset
from meshrun.data.storage import SPLITS, read_meta
from meshrun.data.token_ids import check_token_files
from meshrun.errors import ConfigError
from meshrun.models.hf_config import vocab_key, vocab_size
from meshrun.tasks import Batches, SummedLoss, Task

if TYPE_CHECKING:
    from meshrun.config.schema import Config


def num_labels(cfg: Config) -> int:
    """The labels the model scores (check_task allows the encoder and Hugging Face models with model.num_labels)."""
    assert isinstance(cfg.model, EncoderSection | HFSection), "task classification trains model.name encoder or hf"
    assert cfg.model.num_labels is not None, "check_task requires model.num_labels for a Hugging Face classifier"
    return cfg.model.num_labels


def open_split(cfg: Config, data_dir: Path, split: str) -> LabelledDataset:
    return LabelledDataset(data_dir, split, seq_len=cfg.model.seq_len, seed=cfg.train.seed)


def sample_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over the samples of the cross-entropy of logits (B, num_labels) against labels (B,)."""
    return F.cross_entropy(logits.float(), labels, reduction="sum")


class WeightedCrossEntropy:
    """Sum over the samples of each one's cross-entropy times its label's weight: torch's
    `F.cross_entropy(weight=...)` with reduction sum (the normalisation divides by `total`)."""

    def __init__(self, weights: list[float]) -> None:
        self.weights = np.asarray(weights, dtype=np.float64)
        self.on_device: dict[torch.device, torch.Tensor] = {}  # copied once per device, not per microbatch

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight = self.on_device.get(logits.device)
        if weight is None:
            weight = self.on_device[logits.device] = torch.tensor(self.weights, dtype=torch.float32).to(logits.device)
        return F.cross_entropy(logits.float(), labels, weight=weight, reduction="sum")

    def total(self, data: Batches, first: int, count: int) -> float:
        """The summed weights of samples first .. first+count-1's labels (read from the data, no collective)."""
        assert isinstance(data, LabelledDataset)
        return float(self.weights[data.label_ids[data.rows(first, count)]].sum())


def label_weights(cfg: Config, data_dir: Path) -> list[float] | None:
    """task_options.class_weights as one weight per label id (None: unweighted); a label the data
    lacks, a list of another length, or weights that leave every label out, refused in one line."""
    chosen = cfg.task_options.class_weights
    if chosen is None:
        return None
    train = open_split(cfg, data_dir, "train")
    labels, key = train.labels, "task_options.class_weights"
    if chosen == "balanced":
        rows = np.bincount(train.label_ids, minlength=len(labels))
        if not rows.all():
            raise ConfigError(
                f"{key} balanced: label {labels[int(np.argmin(rows))]!r} has no training rows in {data_dir}; "
                "give the weights as a {label: weight} mapping"
            )
        weights = (len(train.label_ids) / (len(labels) * rows)).tolist()
    elif isinstance(chosen, list):
        if len(chosen) != len(labels):
            raise ConfigError(
                f"{key} lists {len(chosen)} weights but {data_dir} holds {len(labels)} labels "
                f"({', '.join(labels)}); give one weight per label, or a {{label: weight}} mapping"
            )
        weights = list(chosen)
    else:
        unknown = sorted(set(chosen) - set(labels))
        if unknown:
            raise ConfigError(
                f"{key} weighs label {unknown[0]!r}, which {data_dir} does not hold (labels: {', '.join(labels)})"
            )
        weights = [chosen.get(label, 1.0) for label in labels]
    if not any(w > 0 for w in weights):
        raise ConfigError(f"{key} gives every label weight 0: no sample would count; give some label a positive weight")
    return weights


def bind(cfg: Config, data_dir: Path) -> Task:
    """The task with the job's class weights (unweighted: TASK itself)."""
    weights = label_weights(cfg, data_dir)
    if weights is None:
        return TASK
    loss = WeightedCrossEntropy(weights)
    return dataclasses.replace(
        TASK,
        summed=lambda cfg: loss,
        meter=lambda cfg, device: Confusion(num_labels(cfg), device, loss=loss),
        weighted=loss.total,
    )


class Confusion:
    """Validation's meter: the loss, and a confusion matrix (true label x predicted label) counted on the device."""

    def __init__(self, num_labels: int, device: torch.device, *, loss: SummedLoss = sample_cross_entropy) -> None:
        self.num_labels, self.loss = num_labels, loss
        self.matrix = torch.zeros(num_labels * num_labels, dtype=torch.float64, device=device)

    def summed(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cell = targets * self.num_labels + output.argmax(-1)
        self.matrix += torch.bincount(cell, minlength=self.num_labels**2).to(self.matrix.dtype)
        return self.loss(output, targets)

    def counts(self) -> list[float]:
        return self.matrix.tolist()

    def figures(self, counts: list[float]) -> dict[str, float]:
        return confusion_figures(torch.tensor(counts, dtype=torch.float64).view(self.num_labels, self.num_labels))


def confusion_figures(matrix: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro F1 of a confusion matrix (rows: true labels, columns: predictions)."""
    hits = matrix.diagonal()
    true, predicted = matrix.sum(1), matrix.sum(0)
    seen = (true + predicted) > 0
    f1 = 2 * hits / (true + predicted).clamp(min=1)  # 2TP / (2TP + FP + FN)
    return {
        "accuracy": (hits.sum() / matrix.sum().clamp(min=1)).item(),
        "macro_f1": (f1[seen].mean() if seen.any() else torch.zeros(())).item(),
    }


def check_data(cfg: Config, data_dir: Path) -> None:
    """The folder holds classification data with model.num_labels labels, token ids the model can embed."""
    if cfg.data.mixture or cfg.data.format != "meshrun":
        raise ConfigError(
            "task classification reads a folder `meshrun prepare-data --task classification` wrote: "
            "remove data.mixture / data.format"
        )
    for split in SPLITS:
        data = open_split(cfg, data_dir, split)
        check_vocab(data.vocab_size, vocab_size(cfg.model), data.where, key=vocab_key(cfg.model))
        check_token_files(data.files, vocab_size=data.vocab_size, model_vocab_size=vocab_size(cfg.model))
    if isinstance(cfg.model, HFSection):
        from meshrun.models.hf_classifier import check_data_tokens

        check_data_tokens(cfg.model, data)
    if num_labels(cfg) != len(data.labels):
        raise ConfigError(
            f"{data_dir} holds {len(data.labels)} labels (meta.json) but model.num_labels is {num_labels(cfg)}; "
            f"set model.num_labels: {len(data.labels)}"
        )
    label_weights(cfg, data_dir)


@torch.no_grad()
def predict(model: nn.Module, cfg: Config, data: Path, texts: list[str]) -> list[tuple[str, float]]:
    """Each text's most probable label and its probability: encoded with the training data's tokenizer
    (`data`: its card, meta.json beside tokenizer.json), cut to model.seq_len tokens as training cut them."""
    from meshrun.generation.sample import codec

    labels = (read_meta(data) or {}).get("labels")
    if not isinstance(labels, list) or len(labels) != num_labels(cfg):
        raise ConfigError(
            f"{data / 'meta.json'} lists no {num_labels(cfg)} labels; the checkpoint's data card is damaged"
        )
    encode = codec(cfg, data)[0]
    ids = torch.full((len(texts), cfg.model.seq_len), PAD, dtype=torch.long)
    for row, text in enumerate(texts):
        tokens = encode(text)[: cfg.model.seq_len]
        if not tokens:
            raise ConfigError(f"--text {text!r} encodes to no tokens; give some text")
        ids[row, : len(tokens)] = torch.tensor(tokens)
    probabilities = torch.softmax(model(ids).float(), dim=-1)
    best = probabilities.max(-1)
    return [(str(labels[k]), p) for k, p in zip(best.indices.tolist(), best.values.tolist())]


TASK = Task(
    "classification",
    open_split=open_split,
    summed=lambda cfg: sample_cross_entropy,
    meter=lambda cfg, device: Confusion(num_labels(cfg), device),
    check_data=check_data,
    predict=predict,
    bind=bind,
)
