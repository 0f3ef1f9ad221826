"""Encoder-decoder on length-bucketed batches (global batches change shape from step to step)
under every pipeline schedule family, AMP and resharded resume, each against one process.

One one-process fp32 run is the reference (its step 1 checked against torch's nn.Transformer on
the same bucketed global batch); each layout run covers several properties at once to keep the
file cheap: dp2 x pp2 1F1B (bucket parity, writes the checkpoint), its step-3 checkpoint resumed
as dp1 x pp2 interleaved 1F1B, zero-bubble (dp1: refused under DDP with dp > 1), fp16 with
GradScaler on dp2 x pp2, and bf16 autocast on pp2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import final_weights, losses, max_weight_diff, read_metrics, tiny
from encdec_reference import TorchEncDec, assert_same_training, plain_step, train_encdec
from plain_reference import config_from_set_args

from meshrun.data.dataset import open_dataset
from meshrun.models.encdec import source_len
from meshrun.parallel.materialise import materialise_part

STEPS = 6
BUCKETED = {
    "model.name": "encdec",
    "model.num_layers": 4,
    "model.seq_len": 40,
    "model.source_len": 20,
    "model.vocab_size": 260,
    "model.tie_embeddings": True,
    "data.buckets": [10, 20],  # steps 1-6 run batches 10, 10, 40, 20, 20, 20 wide
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.steps": STEPS,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
    "train.eval_interval": 3,  # validation batches of their own bucket shapes, between training steps
    "train.eval_batches": 2,
}
DP2_PP2 = {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b"}


def train(lopsided_dir: Path, run: Path, **overrides: object) -> Path:
    return train_encdec(lopsided_dir, run, BUCKETED, **overrides)


@pytest.fixture(scope="module")
def reference(lopsided_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(lopsided_dir, tmp_path_factory.mktemp("ref") / "run")


@pytest.fixture(scope="module")
def dp2_pp2(lopsided_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(lopsided_dir, tmp_path_factory.mktemp("dp2pp2") / "run", **DP2_PP2, **{"checkpoint.interval": 3})


def global_batches(lopsided_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = config_from_set_args(tiny(lopsided_dir, "unused", **BUCKETED))
    data = open_dataset(
        cfg.data,
        lopsided_dir,
        "train",
        seq_len=40,
        seed=cfg.train.seed,
        source_len=source_len(cfg.model),
        global_batch=8,
    )
    return [data.batch(step * 8, 8) for step in range(STEPS)]


def test_one_process_on_buckets_equals_torch_transformer(reference: Path, lopsided_dir: Path) -> None:
    """Step 1 (a short bucket) equals nn.Transformer on that padded batch: loss and gradient norm."""
    batches = global_batches(lopsided_dir)
    assert len({x.shape[1] for x, _ in batches}) >= 2, "the run must change batch shape between steps"
    cfg = config_from_set_args(tiny(lopsided_dir, "unused", **BUCKETED))
    torch_model = TorchEncDec(materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True))
    x, y = batches[0]
    assert x.shape[1] < 40
    torch_model.source_len = x.shape[1] - y.shape[1]  # the batch's own split: source, then target
    loss, norm = plain_step(torch_model, x, y)
    first = read_metrics(reference)[0]
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_throughput_counts_each_bucket_at_its_length(reference: Path, lopsided_dir: Path) -> None:
    """tokens/s and TFLOP/s count the positions each step trained on, priced at their length: a
    10-wide batch is a quarter of a 40-wide one's tokens, and its attention is cheaper per token."""
    from meshrun.models.families import flops_at

    widths = [x.shape[1] for x, _ in global_batches(lopsided_dir)]
    rows = [row for row in read_metrics(reference) if "tokens_per_s" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # one row per step
    cfg = config_from_set_args(tiny(lopsided_dir, "unused", **BUCKETED))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    for row, width in zip(rows, widths):
        assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(8 * width, rel=1e-6)
        assert row["tflops"] * 1e12 * row["step_time_s"] == pytest.approx(8 * width * flops_at(model, width), rel=1e-6)


def val_losses(run: Path) -> list[float]:
    return [row["val_loss"] for row in read_metrics(run) if "val_loss" in row]


def test_val_loss_is_the_token_mean_over_all_validation_batches(reference: Path, lopsided_dir: Path) -> None:
    """The final validation (step 6, final weights) equals plain cross-entropy summed over every
    target token of both validation batches / their count: batches of different widths and
    paddings are weighted by their tokens, not averaged as batch means."""
    from meshrun.cli.use_checkpoint import load_full_model

    model = load_full_model(reference)[0].eval()
    cfg = config_from_set_args(tiny(lopsided_dir, "unused", **BUCKETED))
    data = open_dataset(
        cfg.data, lopsided_dir, "val", seq_len=40, seed=cfg.train.seed, source_len=source_len(cfg.model), global_batch=8
    )
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in (data.batch(0, 8), data.batch(8, 8)):
            total += torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
            count += int((y != -100).sum())
    assert val_losses(reference)[-1] == pytest.approx(total / count, abs=1e-5)


def test_dp2_pp2_on_buckets_matches_one_process(dp2_pp2: Path, reference: Path) -> None:
    assert_same_training(dp2_pp2, reference)
    assert len(val_losses(reference)) == 2
    assert val_losses(dp2_pp2) == pytest.approx(val_losses(reference), abs=1e-5)


def test_resumed_as_interleaved_pp2_continues_identically(
    dp2_pp2: Path, reference: Path, lopsided_dir: Path, tmp_path: Path
) -> None:
    """dp2 x pp2's step-3 checkpoint, resumed as dp1 x pp2 with interleaved 1F1B (4 stages):
    the same data position and weights, so steps 4-6 equal the one-process run."""
    checkpoint = dp2_pp2 / "checkpoints" / "step-00000003"
    run = train(
        lopsided_dir,
        tmp_path / "run",
        **{"parallel.pp": 2, "parallel.schedule": "interleaved-1f1b", "train.resume": checkpoint},
    )
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-5
    assert losses(run) == pytest.approx(losses(reference)[3:], abs=1e-5)


def test_zero_bubble_on_buckets_matches_one_process(reference: Path, lopsided_dir: Path, tmp_path: Path) -> None:
    run = train(lopsided_dir, tmp_path / "run", **{"parallel.pp": 2, "parallel.schedule": "zero-bubble"})
    assert_same_training(run, reference)
    assert val_losses(run) == pytest.approx(val_losses(reference), abs=1e-5)


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel.dp": 2, "parallel.dp_mode": "fsdp", "parallel.pp": 2, "parallel.schedule": "looped-bfs"},
        {"parallel.pp": 2, "parallel.schedule": "zbv", "train.eval_interval": 0},  # zbv cannot evaluate (torch 2.13)
    ],
    ids=["fsdp-dp2xpp2-looped-bfs", "zbv-pp2"],
)
def test_fsdp_and_torchs_other_schedules_on_buckets_match_one_process(
    layout: dict, reference: Path, lopsided_dir: Path, tmp_path: Path
) -> None:
    """FSDP2 sharding each stage over dp, and the schedules taken from torch beyond the four
    (looped BFS, the V-shaped zero-bubble), on the same changing batch shapes."""
    run = train(lopsided_dir, tmp_path / "run", **layout)
    assert_same_training(run, reference)
    if layout.get("train.eval_interval") != 0:
        assert val_losses(run) == pytest.approx(val_losses(reference), abs=1e-5)


@pytest.mark.parametrize(
    "precision,layout",
    [("fp16", DP2_PP2), ("bf16", {"parallel.pp": 2, "parallel.schedule": "gpipe"})],
    ids=["fp16-dp2xpp2", "bf16-pp2"],
)
def test_mixed_precision_on_buckets_tracks_fp32(
    precision: str, layout: dict, reference: Path, lopsided_dir: Path, tmp_path: Path
) -> None:
    run = train(lopsided_dir, tmp_path / "run", precision=precision, **layout)
    got, fp32 = losses(run), losses(reference)
    assert len(got) == STEPS and got != fp32  # autocast ran (not bit-identical) ...
    assert got == pytest.approx(fp32, rel=0.02)  # ... and tracks fp32 through every bucket shape
    if precision == "fp16":
        rows = [r for r in read_metrics(run) if "loss_scale" in r]
        assert len(rows) == STEPS and rows[-1]["skipped_steps"] == 0
