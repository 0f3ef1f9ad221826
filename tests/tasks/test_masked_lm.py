"""task masked_lm end to end: one process's first step equals an independent plain-torch encoder
(torch's own multi-head attention, a per-position head written here) on the same global batch,
masked by data/masking.py's function directly: loss = mean cross-entropy over the WHOLE batch's
masked positions, and the pre-clip gradient norm; dp2 x pp2 masks the same positions of each
sample and equals one process in weights and validation figures after 10 clipped AdamW steps; the
example config trains past the most-frequent-token baseline. Protein-like character sequences."""

from __future__ import annotations

import json
import random
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
    tiny,
    train_job,
)
from plain_reference import config_from_set_args, plain_blocks

from meshrun import cli
from meshrun.config.schema import load_config
from meshrun.data.dataset import TokenDataset
from meshrun.data.masked_batches import MaskedWindows
from meshrun.data.masking import mask_tokens, rule_of
from meshrun.data.prepare import prepare
from meshrun.data.proteins import AMINO_ACIDS, DOMAIN_LENGTH, example_proteins
from meshrun.data.storage import IGNORE, read_meta
from meshrun.parallel.layout import Layout
from meshrun.parallel.materialise import materialise_part

CONFIGS = Path(__file__).parents[2] / "configs"
MOTIFS = ["MKTAYIAKQR", "GSHMLEDPVV", "WYCNFQRSTE", "PLKIVDAGGH"]
MLM = {
    "task": "masked_lm",
    "model.name": "encoder",
    "model.vocab_size": 257,  # bytes + the mask token
    "model.seq_len": 24,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
    "train.eval_interval": 10,
    "train.eval_batches": 2,
}
DP2_PP2 = {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.dp_mode": "fsdp"}


@pytest.fixture(scope="module")
def masked_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 protein-like sequences, one a record: motifs of 10 amino acids in a random order, one
    residue in ten swapped at random (a masked residue is mostly predictable from its motif)."""
    rng = random.Random(0)
    source = tmp_path_factory.mktemp("proteins") / "proteins.jsonl"
    rows = []
    for _ in range(200):
        residues = list("".join(rng.choice(MOTIFS) for _ in range(rng.randint(3, 8))))
        for k in range(0, len(residues), 10):
            residues[k + rng.randrange(10)] = rng.choice("ACDEFGHIKLMNPQRSTVWY")
        rows.append(json.dumps({"text": "".join(residues)}))
    source.write_text("\n".join(rows) + "\n")
    out = tmp_path_factory.mktemp("data") / "masked"
    prepare([str(source)], out, val_fraction=0.2, task="masked_lm", progress=False)
    return out


def train(data: Path, run: Path, **overrides: object) -> Path:
    train_job(tiny(data, run, **{**MLM, **overrides}), tmp_path=run.parent)
    return run


@pytest.fixture(scope="module")
def one_process(masked_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(masked_dir, tmp_path_factory.mktemp("one") / "run")


@pytest.fixture(scope="module")
def dp2_pp2(masked_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 and full recompute on the way: the (hidden, mask) state through both."""
    return train(masked_dir, tmp_path_factory.mktemp("dp2pp2") / "run", **DP2_PP2, recompute="full")


def plain_masked_lm(w: dict[str, torch.Tensor], ids: torch.Tensor, *, num_layers: int, num_heads: int) -> torch.Tensor:
    """Logits (B, T, vocab) of meshrun's encoder weights `w` with a tokens head, written from the
    definitions: embeddings, pre-LN blocks attending both ways (torch's multi_head_attention_forward,
    no mask: windows have no padding), final LayerNorm, a linear head at every position."""
    h = F.embedding(ids, w["embed.tok.weight"]) + w["embed.pos.weight"][: ids.shape[1]]
    h = plain_blocks(w, h, num_layers=num_layers, num_heads=num_heads)
    return F.linear(h, w["head.weight"])


def plain_batch(data: Path, split: str, count: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples 0 .. count-1 of `split`: meshrun's windows, masked here by data/masking.py's function."""
    tokens = TokenDataset(data, split, seq_len=24, seed=seed).batch(0, count)[0]
    rule = rule_of(read_meta(data) or {}, 0.15)
    inputs, targets = mask_tokens(tokens.numpy(), np.arange(count), seed=seed, rule=rule)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def test_one_process_step_one_equals_a_plain_torch_encoder(masked_dir: Path, one_process: Path) -> None:
    cfg = config_from_set_args(tiny(masked_dir, "unused", **MLM))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    w = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    x, y = plain_batch(masked_dir, "train", 8, seed=cfg.train.seed)
    assert (x == 256).any() and 8 <= (y != IGNORE).sum() < 0.4 * y.numel()  # masked, some positions only
    logits = plain_masked_lm(w, x, num_layers=cfg.model.num_layers, num_heads=cfg.model.num_heads)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    grads = torch.autograd.grad(loss, list(w.values()))
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    assert losses(one_process)[0] == pytest.approx(loss.item(), rel=1e-5)
    assert grad_norms(one_process)[0] == pytest.approx(norm, rel=1e-5)


def test_dp2_pp2_trains_as_one_process(one_process: Path, dp2_pp2: Path) -> None:
    """The sum of masked-token losses / the global batch's masked positions: every layout the same
    gradient, so the same weights after 10 clipped steps and the same validation figures."""
    assert max_weight_diff(final_weights(dp2_pp2), final_weights(one_process)) < 1e-5
    names = ("val_loss", "val_accuracy", "val_majority_accuracy", "val_perplexity")
    figures = [[row[k] for k in names] for r in (dp2_pp2, one_process) for row in read_metrics(r) if "val_loss" in row]
    assert figures[0] == pytest.approx(figures[1], rel=1e-5)


def test_tp2_steps_equal_one_process(masked_dir: Path, one_process: Path, tmp_path: Path) -> None:
    """Tensor parallel (the encoder's tp plan: GPT's block split, the vocabulary split in the
    embedding, the tokens head whole on each tp rank): the first two steps equal one process's."""
    run = train(masked_dir, tmp_path / "run", **{"parallel.tp": 2, "train.steps": 2, "train.eval_interval": 0})
    assert losses(run) == pytest.approx(losses(one_process)[:2], rel=1e-5)
    assert grad_norms(run) == pytest.approx(grad_norms(one_process)[:2], rel=1e-5)


def test_each_sample_is_masked_alike_at_dp1_and_dp2_pp2(masked_dir: Path, dp2_pp2: Path) -> None:
    """What each rank of the dp2 x pp2 run fed (its config read back, its layout's data shard of each
    global batch, as the trainer reads it) masks sample i's positions as the one-process batch does,
    and as data/masking.py does given the global index."""
    cfg = load_config(dp2_pp2 / "config.json")
    layout, count = Layout.of(cfg.parallel), cfg.train.global_batch
    data = MaskedWindows(masked_dir, "train", seq_len=24, seed=cfg.train.seed, rate=0.15)
    for position in (0, 9 * count):  # the first and the last step's samples
        whole = data.batch(position, count)
        for rank in range(layout.world_size):
            shard = layout.data_shard(rank, count)
            fed = data.batch(position + shard.start, len(shard))
            assert torch.equal(fed[0], whole[0][shard.start : shard.stop])
            assert torch.equal(fed[1], whole[1][shard.start : shard.stop])
    x, y = plain_batch(masked_dir, "train", count, seed=cfg.train.seed)
    assert torch.equal(data.batch(0, count)[0], x) and torch.equal(data.batch(0, count)[1], y)
    assert data.target_tokens(0, count) == (y != IGNORE).sum()


def test_validation_figures_equal_those_of_the_final_weights(masked_dir: Path, one_process: Path) -> None:
    """The run validates after its last step: its figures are those of its final weights through the
    plain encoder on validation samples 0 .. 15 (2 batches of 8), counted here."""
    x, y = plain_batch(masked_dir, "val", 16, seed=1337)
    logits = plain_masked_lm(final_weights(one_process), x, num_layers=4, num_heads=2)
    chosen = y != IGNORE
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE).item()
    row = next(row for row in read_metrics(one_process) if "val_loss" in row)
    assert row["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert row["val_perplexity"] == pytest.approx(np.exp(loss), rel=1e-5)
    assert row["val_accuracy"] == pytest.approx((logits.argmax(-1) == y)[chosen].float().mean().item())
    assert row["val_majority_accuracy"] == pytest.approx(y[chosen].bincount().max().item() / chosen.sum().item())


def test_the_example_config_trains_past_the_most_frequent_token(tmp_path: Path) -> None:
    """configs/mlm-tiny.yaml as it is but smaller and shorter, on sequences that each repeat one letter
    (a masked letter is its neighbours': learnt in a few dozen steps): its validation accuracy beats
    always guessing the most frequent letter by far."""
    rng = random.Random(1)
    source = tmp_path / "runs.jsonl"
    source.write_text(
        "".join(json.dumps({"text": rng.choice(MOTIFS[0]) * rng.randint(20, 60)}) + "\n" for _ in range(300))
    )
    prepare([str(source)], tmp_path / "data", val_fraction=0.2, task="masked_lm", progress=False)
    settings = {
        **{"data.dir": tmp_path / "data", "run_dir": tmp_path / "run", "model.dim": 32, "model.seq_len": 24},
        **{"train.steps": 60, "train.eval_interval": 60, "train.eval_batches": 2, "metrics.plots": False},
    }
    config = [str(CONFIGS / "mlm-tiny.yaml"), *(f"--set={k}={v}" for k, v in settings.items())]
    meshrun_in_process(["train", *config], tmp_path=tmp_path)  # one process, no tracker: in this process
    row = next(row for row in read_metrics(tmp_path / "run") if "val_accuracy" in row)
    assert row["val_accuracy"] > row["val_majority_accuracy"] + 0.3


@pytest.mark.parametrize("command", [["train"], ["train", "--dry-run"]])
def test_data_prepared_for_another_task_is_refused_in_one_line(
    command: list[str], data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The session's causal_lm bytes: no mask token recorded."""
    assert cli.main([*command, *tiny(data_dir, tmp_path / "run", **MLM)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds causal_lm data, with no mask token" in err
    assert "prepare-data --task masked_lm" in err
    assert not (tmp_path / "run").exists()  # before any worker


def test_prepare_data_without_sources_writes_the_protein_example(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a masked_lm job's first use does: the generated sequences (data/proteins.py), letters only."""
    assert cli.main(["prepare-data", "--task", "masked_lm", "--out", str(tmp_path / "proteins")]) == 0
    assert "for masked_lm, mask id 256" in capsys.readouterr().out
    data = MaskedWindows(tmp_path / "proteins", "train", seq_len=32, seed=0, rate=0.15)
    tokens = data.windows.batch(0, 64)[0]
    assert set(bytes(tokens.flatten().tolist()).decode()) <= set(AMINO_ACIDS + "\n")
    sequences = example_proteins(40)
    assert sequences == example_proteins(80)[:40] and all(len(s) % DOMAIN_LENGTH == 0 for s in sequences)
