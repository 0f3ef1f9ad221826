"""Hugging Face decoders trained as task classification (models/hf_classifier.py): one process's
first step equals transformers' own LlamaForSequenceClassification (its loss, labels given) on the
same global batch; dp2 x pp2 equals one process after 10 clipped steps; a causal-LM folder loads
under a fresh score head; the export loads back into transformers and predicts what meshrun
predicts; bad input is refused in one line before any worker.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import final_weights, grad_norms, losses, max_weight_diff, read_metrics, tiny, train_job
from hf_models import SEQ_LEN, bpe_json, make_model
from plain_reference import config_from_set_args

from meshrun import cli
from meshrun.data.labelled import Example, prepare_classification
from meshrun.data.labelled_batches import PAD, LabelledDataset
from meshrun.models.families import init_line
from meshrun.models.protocol import fresh_weights
from meshrun.parallel.materialise import materialise_part

PAD_ID = 1  # the tiny llama's eos id, as released Llama configs pad
HEAD_BERT = ("pooler.dense.weight", "pooler.dense.bias", "classifier.weight", "classifier.bias")
CLASSIFIER = "AutoModelForSequenceClassification"
TOPICS = {"animal": ["cat", "dog", "owl"], "colour": ["red", "blue", "teal"], "number": ["one", "two", "six"]}
SETTINGS = {
    "task": "classification",
    "model.num_labels": 3,
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
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """90 texts of 1, 3 or 8 words of their topic, as bytes: padded (3 bytes) and cut (~30 bytes > 16)."""
    rng = random.Random(1)
    rows = []
    for n in range(90):
        topic = rng.choice(sorted(TOPICS))
        rows.append(Example(" ".join(rng.choices(TOPICS[topic], k=rng.choice([1, 3, 8]))), topic, f"gen:{n}"))
    out = tmp_path_factory.mktemp("texts") / "topics"
    prepare_classification(rows, None, out, val_fraction=0.2)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama saved from LlamaForSequenceClassification (3 labels) and from LlamaForCausalLM; BERT from
    BertForSequenceClassification."""
    root = tmp_path_factory.mktemp("hfcls")
    return {
        "classifier": make_model("llama", root / "classifier", auto=CLASSIFIER, num_labels=3, pad_token_id=PAD_ID),
        "causal": make_model("llama", root / "causal", seed=1, pad_token_id=PAD_ID),
        "bert": make_model("bert", root / "bert", auto=CLASSIFIER, num_labels=3),
    }


def settings(texts: Path, run: Path | str, folder: Path, **overrides: object) -> list[str]:
    return tiny(texts, run, **{**SETTINGS, "model.hf": folder, **overrides})


def train(texts: Path, run: Path, folder: Path, **overrides: object) -> Path:
    train_job(settings(texts, run, folder, **overrides), tmp_path=run.parent)
    return run


@pytest.fixture(scope="module")
def one_process(
    texts: Path, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """`one_process(folder)`: a 10-step run on one process, trained on first use and shared after."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train(texts, tmp_path_factory.mktemp(f"one-{name}") / "run", folders[name])
        return done[name]

    return get


def transformers_classifier(folder: Path, **config: object) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(
        folder, attn_implementation="sdpa", dtype=torch.float32, **config
    )


def hf_inputs(x: torch.Tensor, pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """meshrun's padded batch as a transformers user hands it: pad_token_id where PAD is, and the attention mask."""
    ids = x.masked_fill(x == PAD, pad_id)
    return {"input_ids": ids, "attention_mask": (x != PAD).long()}


@pytest.mark.parametrize("name", ["classifier", "bert"])
def test_step_one_equals_transformers_sequence_classification(
    texts: Path, folders: dict[str, Path], one_process: Callable[[str], Path], name: str
) -> None:
    """Loss (transformers' own LlamaForSequenceClassification / BertForSequenceClassification, labels
    given: the mean cross-entropy over the whole global batch of 8) and pre-clip gradient norm of
    step 1, against meshrun's 4 microbatches of 2."""
    seed = config_from_set_args(settings(texts, "unused", folders[name])).train.seed
    x, y = LabelledDataset(texts, "train", seq_len=SEQ_LEN, seed=seed).batch(0, 8)
    assert (x == PAD).any() and (x != PAD).all(1).any()  # padded texts and cut ones
    model = transformers_classifier(folders[name]).train()
    loss = model(**hf_inputs(x, model.config.pad_token_id), labels=y).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert losses(one_process(name))[0] == pytest.approx(loss.item(), rel=1e-5)
    assert grad_norms(one_process(name))[0] == pytest.approx(norm, rel=1e-5)


def test_tp2_step_equals_one_process(
    texts: Path, folders: dict[str, Path], one_process: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Tensor parallel (the blocks split as the causal LM's, the vocabulary split in the embedding,
    `score` whole): the first two steps' losses and pre-clip gradient norms equal one process's
    (which equals transformers' own classifier, above)."""
    run = tmp_path_factory.mktemp("tp2") / "run"
    train(texts, run, folders["classifier"], **{"parallel.tp": 2, "train.steps": 2, "train.eval_interval": 0})
    one = one_process("classifier")
    assert losses(run) == pytest.approx(losses(one)[:2], rel=1e-5)
    assert grad_norms(run) == pytest.approx(grad_norms(one)[:2], rel=1e-5)


@pytest.mark.parametrize("name", ["classifier", "bert"])
def test_dp2_pp2_trains_as_one_process(
    texts: Path, folders: dict[str, Path], one_process: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    """The last stage pools (the keep-mask travels from the first stage) and owns the loss: the same
    weights after 10 clipped steps, and the same validation figures. FSDP2 and full recompute on the way."""
    layout = {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "parallel.dp_mode": "fsdp"}
    run = train(texts, tmp_path / "run", folders[name], **layout, recompute="full")
    assert max_weight_diff(final_weights(run), final_weights(one_process(name))) < 1e-5
    figures = [
        [row[k] for k in ("val_loss", "val_accuracy", "val_macro_f1")]
        for r in (run, one_process(name))
        for row in read_metrics(r)
        if "val_loss" in row
    ]
    assert figures[0] == pytest.approx(figures[1], rel=1e-5)


def test_export_loads_in_transformers_and_predicts_as_meshrun(
    one_process: Callable[[str], Path], tmp_path: Path, capsys
) -> None:
    """`export --hf` writes a LlamaForSequenceClassification folder; on meshrun's padded texts its
    probabilities are those `meshrun predict` prints."""
    run, out = one_process("classifier"), tmp_path / "exported"
    assert cli.main(["export", str(run), "--hf", str(out)]) == 0
    assert "as a Hugging Face model to" in capsys.readouterr().out
    model = transformers_classifier(out).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.id2label == dict(enumerate(sorted(TOPICS)))  # the data's label names, not LABEL_0
    phrases = ["cat dog", "teal red blue red teal"]
    assert cli.main(["predict", str(run), *(f"--text={t}" for t in phrases)]) == 0
    printed = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    x = torch.full((2, SEQ_LEN), PAD)
    for row, text in enumerate(phrases):
        ids = list(text.encode())[:SEQ_LEN]
        x[row, : len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        best = torch.softmax(model(**hf_inputs(x)).logits, -1).max(-1)
    assert [line[0] for line in printed] == [sorted(TOPICS)[k] for k in best.indices.tolist()]
    assert [float(line[1]) for line in printed] == pytest.approx(best.values.tolist(), abs=1e-4)


@pytest.fixture(scope="module")
def more_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GPT-2 (learned positions) saved from GPT2ForSequenceClassification; a Llama causal LM with a tied head."""
    root = tmp_path_factory.mktemp("more")
    return {
        "gpt2": make_model("gpt2", root / "gpt2", auto=CLASSIFIER, num_labels=3, pad_token_id=PAD_ID),
        "tied": make_model("llama", root / "tied", seed=2, pad_token_id=PAD_ID, tie_word_embeddings=True),
        "bert-mlm": make_model("bert", root / "bert-mlm", seed=3, auto="AutoModelForMaskedLM"),
    }


@pytest.mark.parametrize("name", ["causal", "tied", "gpt2", "bert-mlm"])
def test_logits_equal_transformers_classifier_of_the_folder(
    texts: Path, folders: dict[str, Path], more_folders: dict[str, Path], name: str
) -> None:
    """transformers' own classifier from the same folder, with meshrun's head copied in where the
    folder has none (a causal LM's score, BertForMaskedLM's pooler and classifier: meshrun draws them
    seeded, transformers its own): the same logits. The body loads whole, an lm_head (tied or not)
    or BERT's MLM head is left out."""
    folder = {**folders, **more_folders}[name]
    cfg = config_from_set_args(settings(texts, "unused", folder))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    reference = transformers_classifier(folder, num_labels=3).eval()
    drawn = fresh_weights(model)
    assert drawn == {"gpt2": [], "bert-mlm": [f"head.{p}" for p in HEAD_BERT]}.get(name, ["head.weight"])
    theirs = dict(reference.named_parameters())
    with torch.no_grad():
        for ours in drawn:
            theirs[model.hf_names(ours)[0]].copy_(model.get_parameter(ours))
    if drawn:
        assert model.get_parameter(drawn[0]).std().item() == pytest.approx(0.02, rel=0.3)  # not zeros
        line = f"weights loaded from {folder} ({len(model.state_dict()) - len(drawn)} tensors; {', '.join(drawn)} drawn (seed"
        assert init_line(cfg, model).startswith(line)
    x, _ = LabelledDataset(texts, "val", seq_len=SEQ_LEN, seed=0).batch(0, 6)
    assert (x == PAD).any()
    with torch.no_grad():
        logits = reference(**hf_inputs(x, reference.config.pad_token_id)).logits
        torch.testing.assert_close(model(x), logits, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def bad_folders(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders refused for task classification, beside the good ones."""
    root = tmp_path_factory.mktemp("bad")
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text(bpe_json(["cat dog owl red blue teal"], 300))
    return {
        "no-pad": make_model("llama", root / "no-pad"),
        "two-labels": make_model("llama", root / "two", auto=CLASSIFIER, num_labels=2, pad_token_id=PAD_ID),
        "token-head": make_model(
            "llama", root / "token", auto="AutoModelForTokenClassification", num_labels=3, pad_token_id=PAD_ID
        ),
        "with-tokenizer": make_model("llama", root / "tok", auto=CLASSIFIER, num_labels=3, pad_token_id=PAD_ID),
        **folders,
    }


@pytest.mark.parametrize(
    ("folder", "overrides", "message"),
    [
        ("no-pad", {}, "sets no pad_token_id, which last-token pooling needs to find where each text ends"),
        ("two-labels", {}, "with 2 labels (config.json id2label) but model.num_labels is 3"),
        ("causal", {"model.num_labels": 2}, "holds 3 labels (meta.json) but model.num_labels is 2"),
        ("token-head", {}, "was saved from LlamaForTokenClassification; task classification loads a folder saved"),
        (
            "classifier",
            {"model.num_labels": "null"},
            "task classification with a Hugging Face model needs model.num_labels",
        ),
        ("classifier", {"task": "causal_lm"}, "model.num_labels gives a Hugging Face model a classification head"),
        ("with-tokenizer", {}, "holds byte ids, not the tokens of the pretrained model's"),
        (
            "classifier",
            {"parallel.tp": 2, "parallel.sequence_parallel": True},
            "tp_plan has no scatter, norm and gather styles",
        ),
        ("bert", {"parallel.tp": 2}, "parallel.tp 2: meshrun has no tensor-parallel plan for bert"),
        ("bert", {"task": "causal_lm", "model.num_labels": "null"}, "model_type bert is an encoder: meshrun trains"),
        ("classifier", {"model.lora.r": 4}, "model.lora with task classification: the new score head would stay"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_any_worker(
    texts: Path, bad_folders: dict[str, Path], tmp_path: Path, capsys, folder: str, overrides: dict, message: str
) -> None:
    model_dir = bad_folders[folder]
    assert cli.main(["train", *settings(texts, tmp_path / "run", model_dir, **overrides)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_family_without_a_sequence_classification_form_is_refused(
    texts: Path, folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layout meshrun builds has one in transformers 5.24; one taken out of transformers' table is refused."""
    from transformers.models.auto import modeling_auto

    from meshrun.errors import ConfigError
    from meshrun.models.families import build_model

    monkeypatch.delitem(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "llama")
    cfg = config_from_set_args(settings(texts, "unused", folders["classifier"]))
    with pytest.raises(ConfigError, match="model_type llama has no sequence-classification form in transformers"):
        build_model(cfg.model)
