"""task classification end to end: one process's first step equals an independent plain-torch
encoder (torch's own multi-head attention with a key padding mask, mean pooling written here) on
the same global batch: loss = torch's class-weighted cross-entropy over the WHOLE batch (the
weighted sum over the summed weights of the targets), and the pre-clip gradient norm; dp2 x pp2
equals one process at step 1 and in weights and validation figures after 10 clipped AdamW steps.
Texts of very different lengths: most samples are padded, some truncated. The runs weigh their
labels (task_options.class_weights), so every figure checks the weighting too.
"""

from __future__ import annotations

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
from meshrun.data.labelled import Example, prepare_classification
from meshrun.data.labelled_batches import PAD, LabelledDataset
from meshrun.errors import ConfigError
from meshrun.parallel.materialise import materialise_part
from meshrun.tasks.classification import confusion_figures, label_weights

WORDS = {
    "animal": ["cat", "dog", "owl", "yak"],
    "colour": ["red", "blue", "teal", "ochre"],
    "number": ["one", "two", "six", "ten"],
}
CLASSIFY = {
    "task": "classification",
    "model.name": "encoder",
    "model.num_labels": 3,
    "model.seq_len": 24,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
    "train.eval_interval": 10,
    "train.eval_batches": 2,
    "task_options.class_weights": "{animal: 0.5, colour: 2.5}",  # number: 1
}
WEIGHTS = torch.tensor([0.5, 2.5, 1.0])  # in the data's label order: animal, colour, number


@pytest.fixture(scope="module")
def labelled_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """120 generated texts of 1, 2 or 9 words of their label (3 to ~50 bytes), prepared with bytes:
    10 steps learn enough that predictions differ between samples (validation figures mean something)."""
    rng = random.Random(0)
    rows = []
    for n in range(120):
        label = rng.choice(sorted(WORDS))
        words = [rng.choice(WORDS[label]) for _ in range(rng.choice([1, 2, 9]))]
        rows.append(Example(" ".join(words), label, f"generated:{n}"))
    out = tmp_path_factory.mktemp("labelled") / "words"
    prepare_classification(rows, None, out, val_fraction=0.2)
    return out


def train(data: Path, run: Path, **overrides: object) -> Path:
    train_job(tiny(data, run, **{**CLASSIFY, **overrides}), tmp_path=run.parent)
    return run


@pytest.fixture(scope="module")
def one_process(labelled_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(labelled_dir, tmp_path_factory.mktemp("one") / "run")


def plain_encoder(w: dict[str, torch.Tensor], ids: torch.Tensor, *, num_layers: int, num_heads: int) -> torch.Tensor:
    """Logits (B, labels) of meshrun's encoder weights `w`, written from the definitions: pre-LN blocks
    with torch's multi_head_attention_forward (padding as key_padding_mask), GELU MLP, final LayerNorm,
    mean over each sample's tokens, a linear head."""
    keep = ids != PAD
    h = F.embedding(ids.clamp(min=0), w["embed.tok.weight"]) + w["embed.pos.weight"][: ids.shape[1]]
    h = plain_blocks(w, h, num_layers=num_layers, num_heads=num_heads, key_padding_mask=~keep)
    pooled = (h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
    return F.linear(pooled, w["head.weight"], w["head.bias"])


def test_one_process_step_one_equals_a_plain_torch_encoder(labelled_dir: Path, one_process: Path) -> None:
    cfg = config_from_set_args(tiny(labelled_dir, "unused", **CLASSIFY))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    w = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    x, y = LabelledDataset(labelled_dir, "train", seq_len=24, seed=cfg.train.seed).batch(0, 8)
    assert (x == PAD).any() and (x != PAD).all(1).any()  # padded samples and whole (truncated) ones
    logits = plain_encoder(w, x, num_layers=cfg.model.num_layers, num_heads=cfg.model.num_heads)
    loss = F.cross_entropy(logits, y, weight=WEIGHTS)
    assert len(set(y.tolist())) > 1  # the weights' sum differs from the sample count
    grads = torch.autograd.grad(loss, list(w.values()))
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    assert losses(one_process)[0] == pytest.approx(loss.item(), rel=1e-5)
    assert grad_norms(one_process)[0] == pytest.approx(norm, rel=1e-5)


def test_dp2_pp2_trains_as_one_process(labelled_dir: Path, one_process: Path, tmp_path: Path) -> None:
    """The sum of weighted sample losses / the global batch's summed weights: every layout the same
    step-1 loss and gradient norm, the same weights after 10 clipped steps, and the same validation
    loss, accuracy and macro F1. FSDP2 and full recompute on the way: the (hidden, mask) state
    through both."""
    layout = {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.dp_mode": "fsdp"}
    run = train(labelled_dir, tmp_path / "run", **layout, recompute="full")
    assert losses(run)[0] == pytest.approx(losses(one_process)[0], rel=1e-5)
    assert grad_norms(run)[0] == pytest.approx(grad_norms(one_process)[0], rel=1e-5)
    assert max_weight_diff(final_weights(run), final_weights(one_process)) < 1e-5
    figures = [
        [row[k] for k in ("val_loss", "val_accuracy", "val_macro_f1")]
        for r in (run, one_process)
        for row in read_metrics(r)
        if "val_loss" in row
    ]
    assert figures[0] == pytest.approx(figures[1], rel=1e-5)
    assert 0 < figures[1][1] <= 1


def test_tp2_pp2_step_one_equals_one_process(labelled_dir: Path, one_process: Path, tmp_path: Path) -> None:
    """The encoder under tensor parallelism (GPT's block split, the token table split by vocabulary,
    the classifier head whole) and a pipeline in one launch: step 1's loss and pre-clip gradient
    norm those of one process."""
    layout = {"parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "train.steps": 1}
    run = train(labelled_dir, tmp_path / "run", **layout)
    assert losses(run)[0] == pytest.approx(losses(one_process)[0], rel=1e-5)
    assert grad_norms(run)[0] == pytest.approx(grad_norms(one_process)[0], rel=1e-5)


def test_plan_prices_the_classifier_and_compares_its_run(one_process: Path, tmp_path: Path) -> None:
    """`meshrun plan --run`: the finished run's task and layout against the plan's prediction."""
    done = meshrun_in_process(["plan", "--run", one_process, "--gpu", "h100"], tmp_path=tmp_path)
    assert "task classification (vocab 256, 3 labels; head and loss priced on its output, 3 per sample" in done.stdout
    assert any(line.startswith("memory GB, pp rank 0") for line in done.stdout.splitlines())


def test_sequence_parallel_is_refused_in_one_line(
    labelled_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pooling head reads every position of the (hidden, mask) state: no split by position."""
    layout = {"parallel.tp": 2, "parallel.sequence_parallel": True}
    assert cli.main(["train", *tiny(labelled_dir, tmp_path / "run", **{**CLASSIFY, **layout})]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.name encoder's tp_plan has no scatter, norm and gather styles" in err
    assert not (tmp_path / "run").exists()  # before any worker


def test_validation_figures_equal_those_of_the_final_weights(labelled_dir: Path, one_process: Path) -> None:
    """The run validates after its last step: its figures are those of its final weights through the
    plain encoder on the first 16 validation rows (2 batches of 8), counted here label by label; the
    loss weighted as training weighs it, accuracy and macro F1 not."""
    x, y = LabelledDataset(labelled_dir, "val", seq_len=24, seed=0).batch(0, 16)
    logits = plain_encoder(final_weights(one_process), x, num_layers=4, num_heads=2)
    loss, predicted = F.cross_entropy(logits, y, weight=WEIGHTS).item(), logits.argmax(-1)
    f1 = []
    for label in range(3):
        hits, true, guessed = (
            ((predicted == label) & (y == label)).sum(),
            (y == label).sum(),
            (predicted == label).sum(),
        )
        if true + guessed:
            f1.append(2 * hits.item() / (true + guessed).item())
    row = next(row for row in read_metrics(one_process) if "val_loss" in row)
    assert len(set(predicted.tolist())) > 1  # not one label for every text
    assert row["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert row["val_accuracy"] == pytest.approx((predicted == y).float().mean().item())
    assert row["val_macro_f1"] == pytest.approx(sum(f1) / len(f1))


def test_figures_of_a_confusion_matrix() -> None:
    """Rows true labels, columns predictions: accuracy 6/10; F1 per label 2TP/(2TP+FP+FN) = 6/8, 4/8, 2/4;
    a label never seen nor predicted is left out of the macro mean."""
    matrix = torch.tensor([[3, 1, 0, 0], [1, 2, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float64)
    figures = confusion_figures(matrix)
    assert figures["accuracy"] == pytest.approx(6 / 10)
    assert figures["macro_f1"] == pytest.approx(np.mean([6 / 8, 4 / 8, 2 / 4]))


def test_batches_pad_after_each_text_and_read_validation_in_order(labelled_dir: Path) -> None:
    val = LabelledDataset(labelled_dir, "val", seq_len=24, seed=0)
    n = len(val.label_ids)
    x, y = val.batch(0, n + 2)
    assert torch.equal(y, torch.from_numpy(np.concatenate([val.label_ids, val.label_ids[:2]])))
    for row, k in enumerate(range(n)):
        text = val.text.row(k)[:24]
        assert x[row, : len(text)].tolist() == text.tolist() and (x[row, len(text) :] == PAD).all()
    assert val.target_tokens(0, 5) == 5


def test_a_folder_of_another_task_is_refused(labelled_dir: Path, data_dir: Path) -> None:
    with pytest.raises(ConfigError, match="holds meshrun data, not classification data"):
        LabelledDataset(data_dir, "train", seq_len=24, seed=0)


def test_a_label_count_unlike_the_data_is_refused_in_one_line(
    labelled_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = tiny(labelled_dir, tmp_path / "run", **{**CLASSIFY, "model.num_labels": 2})
    assert cli.main(["train", *settings]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 3 labels (meta.json) but model.num_labels is 2" in err
    assert not (tmp_path / "run").exists()  # before any worker


@pytest.mark.parametrize(
    ("weights", "expected"),
    [("[1, 0, 3]", [1.0, 0.0, 3.0]), ("{colour: 0}", [1.0, 0.0, 1.0]), ("BALANCED", None)],
)
def test_class_weights_are_one_per_label_in_the_datas_order(
    labelled_dir: Path, weights: str, expected: list[float] | None
) -> None:
    """A list in meta.json's label order, a mapping (labels not named weigh 1), or balanced:
    rows / (labels x the label's training rows), scikit-learn's rule."""
    cfg = config_from_set_args(tiny(labelled_dir, "unused", **{**CLASSIFY, "task_options.class_weights": weights}))
    if expected is None:
        rows = np.bincount(LabelledDataset(labelled_dir, "train", seq_len=24, seed=0).label_ids, minlength=3)
        expected = (rows.sum() / (3 * rows)).tolist()
    assert label_weights(cfg, labelled_dir) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("{plant: 2}", "task_options.class_weights weighs label 'plant', which "),
        ("[1, 2]", "task_options.class_weights lists 2 weights but "),
        ("{colour: -1}", "class weights must be >= 0"),
        ("[0, 0, 0]", "task_options.class_weights gives every label weight 0"),
    ],
)
def test_bad_class_weights_are_refused_in_one_line(
    labelled_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], weights: str, message: str
) -> None:
    settings = tiny(labelled_dir, tmp_path / "run", **{**CLASSIFY, "task_options.class_weights": weights})
    assert cli.main(["train", *settings]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()  # before any worker


def test_sample_refuses_a_classifier(one_process: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sample", str(one_process), "--prompt", "cat"]) == 2
    assert "is a classification model, which does not generate text" in capsys.readouterr().err


def test_predict_prints_each_texts_label_and_probability(one_process: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The trained weights through the plain encoder on the texts' bytes: the same label and probability."""
    texts = ["cat dog owl", "red teal blue ochre red"]
    assert cli.main(["predict", str(one_process), *(f"--text={t}" for t in texts)]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    w = final_weights(one_process)
    ids = torch.full((2, 24), PAD)
    for row, text in enumerate(texts):
        ids[row, : len(text)] = torch.tensor(list(text.encode()))
    best = torch.softmax(plain_encoder(w, ids, num_layers=4, num_heads=2), -1).max(-1)
    assert [line[0] for line in lines] == [sorted(WORDS)[k] for k in best.indices.tolist()]
    assert [float(line[1]) for line in lines] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert [line[2] for line in lines] == texts


def test_predict_csv_is_refused_for_a_classifier(
    one_process: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "rows.csv"
    table.write_text("load\n1\n")
    assert cli.main(["predict", str(one_process), "--csv", str(table)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this is a classification model: pass --text TEXT to label texts" in err
    assert not (tmp_path / "rows.forecast.csv").exists()
