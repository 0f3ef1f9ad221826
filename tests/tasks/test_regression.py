"""task regression end to end on the generated seasonal series (data/series.py example_series): one
process's first step equals an independent plain-torch forecaster (torch's own multi-head attention
with a causal mask, written from the definitions) on the same global batch: loss = mean squared
error over every predicted value of the WHOLE batch, and the pre-clip gradient norm; dp2 x pp2
equals one process in weights and validation figures after 10 clipped AdamW steps; the validation
figures are those of the final weights (MSE, MAE, and the naive last-value forecast's MAE).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    final_weights,
    grad_norms,
    losses,
    max_weight_diff,
    meshrun_in_process,
    read_metrics,
    run_meshrun,
    tiny,
    train_job,
)
from plain_reference import config_from_set_args, plain_blocks

from meshrun import cli
from meshrun.data.series import EXAMPLE_COLUMNS, example_series, prepare_regression
from meshrun.data.series_batches import SeriesDataset
from meshrun.parallel.materialise import materialise_part
from meshrun.tasks.regression import LOSSES

SEQ_LEN, HORIZON = 12, 3
REGRESS = {
    "task": "regression",
    "model.name": "timeseries",
    "model.features": 2,
    "model.horizon": HORIZON,
    "task_options.horizon": HORIZON,
    "model.seq_len": SEQ_LEN,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
    "train.eval_interval": 10,
    "train.eval_batches": 2,
}


@pytest.fixture(scope="module")
def series_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 days of the generated load and temperature, the last 40 held out for validation."""
    out = tmp_path_factory.mktemp("series") / "load"
    prepare_regression(
        [example_series(400)], list(EXAMPLE_COLUMNS), out, seq_len=SEQ_LEN, horizon=HORIZON, val_fraction=0.1
    )
    return out


def train(data: Path, run: Path, **overrides: object) -> Path:
    train_job(tiny(data, run, **{**REGRESS, **overrides}), tmp_path=run.parent)
    return run


@pytest.fixture(scope="module")
def one_process(series_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(series_dir, tmp_path_factory.mktemp("one") / "run")


def plain_forecaster(w: dict[str, torch.Tensor], x: torch.Tensor, *, num_layers: int, num_heads: int) -> torch.Tensor:
    """Forecasts (B, horizon, features) of meshrun's timeseries weights `w`, written from the
    definitions: a linear value projection plus learned positions, pre-LN blocks with torch's
    multi_head_attention_forward under a causal mask, GELU MLP, final LayerNorm, and a linear map of
    the last step's state to horizon x features values."""
    b, t, features = x.shape
    h = F.linear(x, w["embed.value.weight"], w["embed.value.bias"]) + w["embed.pos.weight"][:t]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # True: may not attend
    h = plain_blocks(w, h, num_layers=num_layers, num_heads=num_heads, attn_mask=future)
    return F.linear(h[:, -1], w["head.weight"], w["head.bias"]).view(b, -1, features)


def windows(data: Path, split: str, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(past, last past value, future) of samples 0 .. count-1 of a split (the runs' seed), read from its windows."""
    seed = config_from_set_args(tiny(data, "unused", **REGRESS)).train.seed
    x, y = SeriesDataset(data, split, seq_len=SEQ_LEN, horizon=HORIZON, seed=seed).batch(0, count)
    assert torch.equal(y[:, 0], x[:, -1])  # the naive forecast travels with the targets
    return x, y[:, :1], y[:, 1:]


def test_one_process_step_one_equals_a_plain_torch_forecaster(series_dir: Path, one_process: Path) -> None:
    cfg = config_from_set_args(tiny(series_dir, "unused", **REGRESS))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    w = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    x, _, future = windows(series_dir, "train", 8)
    forecast = plain_forecaster(w, x, num_layers=cfg.model.num_layers, num_heads=cfg.model.num_heads)
    loss = F.mse_loss(forecast, future)  # the mean over all 8 x 3 x 2 values
    grads = torch.autograd.grad(loss, list(w.values()))
    norm = torch.stack([(g.double() ** 2).sum() for g in grads]).sum().sqrt().item()
    assert losses(one_process)[0] == pytest.approx(loss.item(), rel=1e-5)
    assert grad_norms(one_process)[0] == pytest.approx(norm, rel=1e-5)
    first = read_metrics(one_process)[0]  # throughput counts time steps (8 x 12), not values or features
    assert first["tokens_per_s"] * first["step_time_s"] == pytest.approx(8 * SEQ_LEN, rel=1e-3)


def test_dp2_pp2_trains_as_one_process(series_dir: Path, one_process: Path, tmp_path: Path) -> None:
    """The sum of value losses / the global batch's values: every layout the same gradient, so the
    same weights after 10 clipped steps, and the same validation figures. FSDP2 and full recompute
    on the way."""
    layout = {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.dp_mode": "fsdp"}
    run = train(series_dir, tmp_path / "run", **layout, recompute="full")
    assert max_weight_diff(final_weights(run), final_weights(one_process)) < 1e-5
    keys = ("val_loss", "val_mse", "val_mae", "val_naive_mae")
    figures = [[row[k] for k in keys] for r in (run, one_process) for row in read_metrics(r) if "val_loss" in row]
    assert figures[0] == pytest.approx(figures[1], rel=1e-5)


def test_tp2_sequence_parallel_step_one_equals_one_process(series_dir: Path, one_process: Path, tmp_path: Path) -> None:
    """The forecaster under tensor parallelism with sequence parallel (GPT's block split, the
    positions split from the value embedding to the head, which gathers them), its stages split by
    measured time: step 1's loss and pre-clip gradient norm those of one process."""
    layout = {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.steps": 1}
    run = train(series_dir, tmp_path / "run", **layout)
    assert losses(run)[0] == pytest.approx(losses(one_process)[0], rel=1e-5)
    assert grad_norms(run)[0] == pytest.approx(grad_norms(one_process)[0], rel=1e-5)


def test_plan_prices_the_forecaster_and_compares_its_run(one_process: Path, tmp_path: Path) -> None:
    """`meshrun plan --run`: the finished run's task and layout against the plan's prediction."""
    done = meshrun_in_process(["plan", "--run", one_process, "--gpu", "h100"], tmp_path=tmp_path)
    assert (
        "task regression (2 features per step, forecasts 3 steps; head and loss priced on its output, 3 x 2"
        in done.stdout
    )
    assert any(line.startswith("memory GB, pp rank 0") for line in done.stdout.splitlines())


def test_validation_figures_equal_those_of_the_final_weights(series_dir: Path, one_process: Path) -> None:
    """The run validates after its last step: its figures are those of its final weights through the
    plain forecaster on the first 16 validation windows (2 batches of 8), in standardised units."""
    x, last, future = windows(series_dir, "val", 16)
    forecast = plain_forecaster(final_weights(one_process), x, num_layers=4, num_heads=2)
    row = next(row for row in read_metrics(one_process) if "val_loss" in row)
    assert row["val_loss"] == pytest.approx(F.mse_loss(forecast, future).item(), rel=1e-5)
    assert row["val_mse"] == pytest.approx(row["val_loss"], rel=1e-6)  # the training loss is mse here
    assert row["val_mae"] == pytest.approx((forecast - future).abs().mean().item(), rel=1e-5)
    assert row["val_naive_mae"] == pytest.approx((future - last).abs().mean().item(), rel=1e-5)


@pytest.mark.parametrize("name", ["mse", "mae", "huber"])
def test_each_loss_sums_its_value_losses(name: str) -> None:
    """Written from the definitions: squared error, absolute error, and Huber with delta 1 (half the
    square within 1 of the target, the absolute error less a half beyond), summed over the values."""
    torch.manual_seed(0)
    forecast, targets = torch.randn(4, 3, 2) * 2, torch.randn(4, 4, 2) * 2
    e = (forecast - targets[:, 1:]).abs()
    expected = {"mse": e**2, "mae": e, "huber": torch.where(e <= 1, 0.5 * e**2, e - 0.5)}[name].sum()
    assert LOSSES[name](forecast, targets).item() == pytest.approx(expected.item(), rel=1e-6)


def test_validation_reads_the_tail_in_order_and_counts_values(series_dir: Path) -> None:
    val = SeriesDataset(series_dir, "val", seq_len=SEQ_LEN, horizon=HORIZON, seed=0)
    n = len(val.windows)
    x, y = val.batch(0, n + 1)
    assert torch.equal(x[n], x[0]) and torch.equal(y[n], y[0])  # in order, then from the start again
    assert y.shape == (n + 1, 1 + HORIZON, 2) and val.target_tokens(0, 5) == 5 * HORIZON * 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model.features": 1}, "holds 2 columns (meta.json) but model.features is 1; set model.features: 2"),
        ({"model.horizon": 2}, "model.horizon (2) must equal task_options.horizon (3)"),
        (
            {"model.name": "gpt", "model.features": None, "model.horizon": None},
            "task regression trains model.name timeseries in this version, not gpt",
        ),
        ({"task": "causal_lm", "task_options.horizon": 1}, "model.name timeseries forecasts numeric series"),
    ],
)
def test_what_the_model_cannot_train_is_refused_in_one_line(
    series_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: dict, message: str
) -> None:
    settings = {key: value for key, value in {**REGRESS, **overrides}.items() if value is not None}
    assert cli.main(["train", *tiny(series_dir, tmp_path / "run", **settings)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()  # before any worker


def test_regression_without_prepared_series_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", *tiny(tmp_path / "none", tmp_path / "run", **REGRESS)]) == 2
    assert "task regression reads prepared series, and " in capsys.readouterr().err


def test_the_example_config_beats_the_naive_forecast_on_the_generated_series(tmp_path: Path) -> None:
    """configs/forecast-tiny.yaml as shipped: the generated series prepared on first use into the
    job's cache folder (no data.dir, no download), and after its 300 steps the model's validation MAE
    well below repeating the last value (0.23 vs 0.36 standardised when written)."""
    config = Path(__file__).parents[2] / "configs" / "forecast-tiny.yaml"
    run_meshrun(
        ["train", str(config), f"--set=run_dir={tmp_path / 'run'}", "--set=metrics.plots=false"], tmp_path=tmp_path
    )
    meta = json.loads((tmp_path / "cache" / "meshrun" / "example-series-h7-v0.05" / "meta.json").read_text())
    assert meta["columns"] == list(EXAMPLE_COLUMNS) and meta["rows"] == 3000
    row = [row for row in read_metrics(tmp_path / "run") if "val_loss" in row][-1]
    assert row["step"] == 300 and row["val_mae"] < 0.8 * row["val_naive_mae"]


def test_regression_sources_are_not_prepared_on_first_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = tiny(tmp_path / "new", tmp_path / "run", **REGRESS)
    assert cli.main(["train", *settings, f"--set=data.sources=[{tmp_path / 'prices.csv'}]"]) == 2
    assert "task regression does not prepare data.sources on first use" in capsys.readouterr().err


def test_dry_run_prints_what_the_forecaster_reads(
    series_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its features and horizon, not a vocabulary it has none of (nor model.vocab_size in the config)."""
    assert cli.main(["train", *tiny(series_dir, tmp_path / "run", **REGRESS), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "heads, 2 features per step, forecasts 3 steps, seq_len 12" in out and "vocab" not in out


def test_predict_text_is_refused_for_a_forecaster(one_process: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["predict", str(one_process), "--text", "1"]) == 2
    assert "this is a regression model: pass --csv FILE with its columns to forecast" in capsys.readouterr().err


def recent_csv(path: Path, rows: np.ndarray, header: str = "day,load,temperature") -> Path:
    """A csv of `rows` (load, temperature) in the data's units, a day column first (not read: the data has no time column)."""
    lines = [header, *(f"{day},{load!r},{temperature!r}" for day, (load, temperature) in enumerate(rows.tolist()))]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_predict_csv_writes_the_forecast_of_the_trained_weights(
    series_dir: Path, one_process: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last 12 of 30 rows, standardised with meta.json's mean and std, through the plain
    forecaster with the final weights, back in the data's units: the values written, beside the
    input by default; that file is never written over."""
    rows = example_series(400).values[-30:]
    table = recent_csv(tmp_path / "recent.csv", rows)
    assert cli.main(["predict", str(one_process), "--csv", str(table)]) == 0
    out = tmp_path / "recent.forecast.csv"
    assert f"to {out}" in capsys.readouterr().out
    meta = json.loads((series_dir / "meta.json").read_text())
    mean, std = np.array(meta["mean"]), np.array(meta["std"])
    past = torch.from_numpy(((rows[-SEQ_LEN:] - mean) / std).astype(np.float32))[None]
    expected = plain_forecaster(final_weights(one_process), past, num_layers=4, num_heads=2)[0].double().numpy()
    written = out.read_text().splitlines()
    assert written[0] == "step,load,temperature" and len(written) == 1 + HORIZON
    values = np.array([[float(v) for v in line.split(",")[1:]] for line in written[1:]])
    assert [line.split(",")[0] for line in written[1:]] == ["1", "2", "3"]
    assert values == pytest.approx(expected * std + mean, rel=1e-5)
    before = out.read_bytes()
    assert cli.main(["predict", str(one_process), "--csv", str(table)]) == 2
    assert "already exists (meshrun never writes over a file)" in capsys.readouterr().err
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    ("header", "rows", "message"),
    [
        ("day,load,temp", 20, "recent.csv has no column 'temperature' (columns: day, load, temp); the model reads"),
        ("day,load,temperature", 11, "recent.csv has 11 rows; the model reads the last model.seq_len = 12"),
        (None, 20, "recent.csv:5: column 'load' holds 'n/a', not a number"),
    ],
)
def test_predict_csv_refuses_a_table_it_cannot_read_in_one_line(
    one_process: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], header: str | None, rows: int, message: str
) -> None:
    table = recent_csv(tmp_path / "recent.csv", example_series(400).values[-rows:], header or "day,load,temperature")
    if header is None:  # row 4 (line 5) holds text
        lines = table.read_text().splitlines()
        lines[4] = "3,n/a,1.5"
        table.write_text("\n".join(lines) + "\n")
    assert cli.main(["predict", str(one_process), "--csv", str(table), "--out", str(tmp_path / "f.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "f.csv").exists()
