"""regression: a window of past values -> the next `horizon` values (data/series.py prepares them,
data/series_batches.py batches them). The last stage's output is (B, horizon, features) forecasts
(models/timeseries.py); the targets are (B, 1 + horizon, features): the window's last past value
first (the naive forecast, carried to the last stage so validation can score it beside the model),
then the values to predict. The loss sums a per-value loss (task_options.loss: mse, mae or huber
with delta 1) over the predicted values, which the normalisation divides by the global batch's
count of them (the data's `target_tokens`), so every layout computes the same gradient.

Validation reports, in standardised units (each column scaled by its training rows' std, so 1.0
is one standard deviation): MSE, MAE, and the MAE of the naive forecast that repeats the last
past value for every future step, over the same values.

`meshrun predict RUN --csv FILE` (`forecast`) reads the last model.seq_len rows of a table with the
training data's columns, standardised with the statistics stored with the data, and writes the
model's next `horizon` values per column in the data's own units.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.model_sections import TimeSeriesSection
from meshrun.data.series import recent_rows
from meshrun.data.series_batches import SeriesDataset
from meshrun.data.storage import SPLITS, read_meta
from meshrun.errors import ConfigError
from meshrun.tasks import SummedLoss, Task

if TYPE_CHECKING:
    from meshrun.config.schema import Config


def open_split(cfg: Config, data_dir: Path, split: str) -> SeriesDataset:
    horizon = cfg.task_options.horizon
    return SeriesDataset(data_dir, split, seq_len=cfg.model.seq_len, horizon=horizon, seed=cfg.train.seed)


def _future(targets: torch.Tensor) -> torch.Tensor:
    """The values to predict: the targets after the last past value."""
    return targets[:, 1:].float()


def summed_mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), _future(targets), reduction="sum")


def summed_mae(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(output.float(), _future(targets), reduction="sum")


def summed_huber(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.huber_loss(output.float(), _future(targets), reduction="sum", delta=1.0)


LOSSES: dict[str, SummedLoss] = {"mse": summed_mse, "mae": summed_mae, "huber": summed_huber}


def summed_loss(cfg: Config) -> SummedLoss:
    """task_options.loss, summed over the predicted values."""
    return LOSSES[cfg.task_options.loss]


class Errors:
    """Validation's meter: the training loss, and the squared and absolute errors of the model and
    the absolute errors of the naive last-value forecast, summed on the device."""

    def __init__(self, summed: SummedLoss, device: torch.device) -> None:
        self.loss = summed
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # squared, absolute, naive absolute, values

    def summed(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        future, error = _future(targets), output.float() - _future(targets)
        naive = (future - targets[:, :1].float()).abs().sum()
        self.sums += torch.stack([error.square().sum(), error.abs().sum(), naive, torch.tensor(future.numel())]).to(
            self.sums
        )
        return self.loss(output, targets)

    def counts(self) -> list[float]:
        return self.sums.tolist()

    def figures(self, counts: list[float]) -> dict[str, float]:
        squared, absolute, naive, values = counts
        n = max(values, 1.0)
        return {"mse": squared / n, "mae": absolute / n, "naive_mae": naive / n}


def check_data(cfg: Config, data_dir: Path) -> None:
    """The folder holds regression data with model.features columns and a window of each split for
    model.seq_len + task_options.horizon; the model's head predicts task_options.horizon steps."""
    model, horizon = cfg.model, cfg.task_options.horizon
    assert isinstance(model, TimeSeriesSection), "task regression trains model.name timeseries"
    if cfg.data.mixture or cfg.data.format != "meshrun":
        raise ConfigError(
            "task regression reads a folder `meshrun prepare-data --task regression` wrote: remove data.mixture / data.format"
        )
    if model.horizon != horizon:
        raise ConfigError(
            f"model.horizon ({model.horizon}) must equal task_options.horizon ({horizon}): the head predicts the "
            "steps each window's targets hold; set both"
        )
    for split in SPLITS:
        data = open_split(cfg, data_dir, split)
    if model.features != data.features:
        raise ConfigError(
            f"{data_dir} holds {data.features} columns (meta.json) but model.features is {model.features}; "
            f"set model.features: {data.features}"
        )


@torch.no_grad()
def forecast(model: nn.Module, cfg: Config, data: Path, table: Path) -> str:
    """The model's next horizon values after the last model.seq_len rows of `table` as csv text: a
    header (step, then the training data's columns), one row per future step, in the data's units
    (`data`: the data card, whose meta.json holds the columns, their mean and std)."""
    meta = read_meta(data) or {}
    past = recent_rows(table, meta, count=cfg.model.seq_len)  # (seq_len, columns), standardised
    future = model(torch.from_numpy(past)[None]).double()[0].numpy()  # (horizon, columns)
    values = future * np.array(meta["std"], dtype=np.float64) + np.array(meta["mean"], dtype=np.float64)
    text = io.StringIO()
    table_writer = csv.writer(text, lineterminator="\n")
    table_writer.writerow(["step", *meta["columns"]])
    table_writer.writerows([step, *row] for step, row in enumerate(values.tolist(), 1))  # floats as repr: exact
    return text.getvalue()


TASK = Task(
    "regression",
    open_split=open_split,
    summed=summed_loss,
    meter=lambda cfg, device: Errors(summed_loss(cfg), device),
    check_data=check_data,
    forecast=forecast,
)
