"""Loss normalisation by tokens: a step's loss is the sum of token losses over the global batch /
the global count of non-pad targets, whatever the (dp, pp, microbatch) split. Shown here for a
decoder-only GPT on padded pairs (source, then the target it learns to continue with)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny, train_job
from encdec_reference import (
    assert_same_training,
    assert_step_one_matches,
    lopsided_pairs,
    token_loss,
)
from plain_reference import config_from_set_args

from meshrun.data.dataset import open_dataset
from meshrun.data.pairs import prepare_pairs
from meshrun.parallel.materialise import materialise_part
from meshrun.training.loss import IGNORE, MicrobatchLoss

DECODER = {
    "model.num_layers": 4,
    "model.seq_len": 96,
    "model.vocab_size": 260,
    "train.global_batch": 16,
    "train.micro_batch": 2,
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
}


@pytest.mark.parametrize("dp", [1, 2])
def test_microbatch_losses_add_up_to_the_global_token_mean(dp: int) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 6, 11, generator=generator)
    targets = torch.randint(0, 11, (8, 6), generator=generator)
    for row, length in enumerate([6, 1, 0, 2, 6, 5, 1, 3]):  # padded rows of very different lengths
        targets[row, length:] = IGNORE
    loss = MicrobatchLoss.for_batch(8 // (2 * dp), target_tokens=int((targets != IGNORE).sum()), dp=dp)
    per_rank = [
        sum(loss(lm, tm) for lm, tm in zip(rank_logits.split(2), t.split(2)))
        for rank_logits, t in zip(logits.chunk(dp), targets.chunk(dp))
    ]
    torch.testing.assert_close(sum(per_rank) / dp, token_loss(logits, targets), rtol=1e-6, atol=0)  # DDP averages ranks


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pairs") / "reverse"
    prepare_pairs(lopsided_pairs(200, seed=1), out, val_fraction=0.1)
    return out


def train(pairs_dir: Path, run: Path, **overrides: object) -> Path:
    train_job(tiny(pairs_dir, run, **{**DECODER, **overrides}), tmp_path=run.parent)
    return run


@pytest.fixture(scope="module")
def reference(pairs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(pairs_dir, tmp_path_factory.mktemp("ref") / "run")


def test_decoder_only_padded_step_one_equals_plain_torch(reference: Path, pairs_dir: Path) -> None:
    cfg = config_from_set_args(tiny(pairs_dir, "unused", **DECODER))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    x, y = open_dataset(cfg.data, pairs_dir, "train", seq_len=96, seed=cfg.train.seed).batch(0, 16)
    assert_step_one_matches(reference, model, x, y, micro_batch=2)


def test_decoder_only_dp2xpp2_matches_one_process(reference: Path, pairs_dir: Path, tmp_path: Path) -> None:
    run = train(pairs_dir, tmp_path / "run", **{"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "gpipe"})
    assert_same_training(run, reference)


def test_sample_answers_in_the_pairs_training_format(reference: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A decoder-only model trained on pairs is prompted as it was trained (source ids + 3, BOS)
    and answers until EOS: `meshrun sample` equals a greedy loop over that format written here."""
    from meshrun import cli
    from meshrun.cli.use_checkpoint import load_full_model

    assert cli.main(["sample", str(reference), "--prompt", "abc_def", "--tokens", "12", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    model = load_full_model(reference)[0]
    ids, answer = [b + 3 for b in b"abc_def"] + [1], []
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([ids]))[0, -1, :259]
            logits[:2] = float("-inf")  # pad and BOS never follow
            nxt = int(logits.argmax())
            if nxt == 2:  # EOS ends the answer
                break
            ids.append(nxt)
            answer.append(nxt - 3)
    assert printed == bytes(answer).decode("utf-8", errors="replace")
