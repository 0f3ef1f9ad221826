"""The job's objective as code: one module per task says what a batch holds (the dataset it opens),
what the last stage's loss sums, and what validation reports beside the loss. The trainer, the
pipeline and the loss normalisation (training/loss.py) read a `Task` and never branch on its name.

- `tokens`: causal_lm and seq2seq (token windows, pairs, mixtures): token cross-entropy.
- `classification`: labelled texts: per-sample cross-entropy; accuracy and macro F1.
- `regression`: windows of numeric series: a per-value mse, mae or huber loss; MSE, MAE and the
  naive last-value forecast's MAE.
- `masked_lm`: token windows with masked positions: token cross-entropy over them; masked-token
  accuracy and perplexity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from meshrun.config.schema import Config
    from meshrun.data.packed import Occupancy


SummedLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A task's loss of a microbatch: (the last stage's output, the targets) -> the sum over its targets."""


Predict = Callable[[nn.Module, "Config", Path, list[str]], list[tuple[str, float]]]
"""(the whole model, its config, its data card folder, texts) -> each text's label and its probability."""


Forecast = Callable[[nn.Module, "Config", Path, Path], str]
"""(the whole model, its config, its data card folder, a table of past rows) -> the forecast as csv text."""


class Batches(Protocol):
    """One split of a task's data, addressed by global sample index (any layout reads the same batch)."""

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first+count-1 as (the first stage's input, the last stage's targets)."""
        ...

    def target_tokens(self, first: int, count: int) -> int:
        """The targets those samples hold: what the loss divides by (training/loss.py)."""
        ...

    def source_counts(self, first: int, count: int) -> dict[str, int]: ...


# Optional hooks of a `Batches` (read through the functions below, which give the defaults):
# - `occupancy(first, count) -> Occupancy`: padding and attention cost of rows that pack documents.
# - `positions_per_sample(x) -> int`: the positions a sample of input `x` trains (default: its last
#   dimension, ids (B, T) or packed (B, 2, T)); values (B, T, features) say T.


def occupancy(data: Batches, first: int, count: int) -> Occupancy | None:
    """What samples first .. first+count-1 hold beyond their positions (None: data that packs nothing)."""
    hook = getattr(data, "occupancy", None)
    return None if hook is None else hook(first, count)


def positions_per_sample(data: Batches, x: torch.Tensor) -> int:
    """The positions one sample of the input batch `x` spans (a length bucket's may be shorter than seq_len)."""
    hook = getattr(data, "positions_per_sample", None)
    return x.shape[-1] if hook is None else hook(x)


class Meter(Protocol):
    """What one validation pass counts beside the loss, on the ranks that compute the loss."""

    def summed(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The task's summed loss of a microbatch, counting what the figures need as it goes."""
        ...

    def counts(self) -> list[float]:
        """This rank's counts (zeros where no loss ran): summed over the ranks that count the loss."""
        ...

    def figures(self, counts: list[float]) -> dict[str, float]:
        """The validation figures (name -> value) from every rank's counts summed."""
        ...


@dataclass(frozen=True)
class Task:
    """One task: the data a job of it reads and what its last stage and validation compute."""

    name: str
    open_split: Callable[[Config, Path, str], Batches]
    """(config, data folder, split) -> that split's batches."""
    summed: Callable[[Config], SummedLoss]
    """The job's training loss of a microbatch, summed over its targets (the normalisation divides it)."""
    meter: Callable[[Config, torch.device], Meter]
    """A fresh validation meter."""
    check_data: Callable[[Config, Path], None]
    """Before any worker: the prepared data is this task's, parses, and fits the model."""
    predict: Predict | None = None
    """`meshrun predict --text`, for a task that labels texts (None: the task has none)."""
    forecast: Forecast | None = None
    """`meshrun predict --csv`, for a task that forecasts from a table's rows (None: the task has none)."""
    weighted: Callable[[Batches, int, int], float] | None = None
    """(split, first, count) -> the summed weights of those samples' targets, the loss's divisor where
    targets weigh differently (classification's class weights); None: every target weighs 1."""
    bind: Callable[[Config, Path], Task] | None = None
    """(config, data folder) -> this task with what the job's data decides (class weights); None: nothing."""

    def divisor(self, data: Batches, first: int, count: int, *, targets: int) -> float:
        """What the loss of samples first .. first+count-1 (holding `targets` targets) divides by."""
        return targets if self.weighted is None else self.weighted(data, first, count)


def job_task(cfg: Config, data_dir: Path) -> Task:
    """The config's task bound to the job's data (training/run.py)."""
    task = task_for(cfg.task)
    return task if task.bind is None else task.bind(cfg, data_dir)


def task_for(name: str) -> Task:
    """The `Task` a config's `task` names."""
    from meshrun.tasks import classification, masked_lm, regression, tokens

    tasks = {
        "causal_lm": tokens.TASK,
        "seq2seq": tokens.TASK,
        "classification": classification.TASK,
        "regression": regression.TASK,
        "masked_lm": masked_lm.TASK,
    }
    return tasks[name]
