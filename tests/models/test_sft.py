"""Training on conversations (prepare-data --chat): packed rows equal each conversation run alone
through transformers' own model (labels -100 outside the trained tokens, one backward over the
global batch's token mean), under every layout; a leaky variant differs; resume and resharded
resume continue the same rows; bad input refused in one line before any worker."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_data import CHATML, conversations, write_chat_tokenizer
from conftest import final_weights, max_weight_diff, meshrun_in_process, read_metrics, run_meshrun, tiny, train_job
from hf_models import load_reference, make_model
from plain_reference import config_from_set_args
from test_hf import interrupted
from test_lora import peft_model_with

from meshrun.data.packed import PackedDataset
from meshrun.data.storage import IGNORE

SEQ_LEN = 128
# the fine-tuning template: ChatML with a colon after the role, not the model folder's own
TEMPLATE = CHATML.replace("message['role'] + '\\n'", "message['role'] + ':\\n'").replace(
    "assistant\\n", "assistant:\\n"
)
BASE = {
    "model.seq_len": SEQ_LEN,
    "train.global_batch": 8,
    "train.steps": 10,
    "train.lr": 3e-3,
    "train.grad_clip": 0.5,
    "train.eps": 1e-6,
    "checkpoint.interval": 5,
}
LAYOUTS = {
    "one-process": {},
    "dp2-pp2-1f1b": {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b"},
    "dp2-pp2-interleaved": {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "interleaved-1f1b"},
    "tp2-sequence-parallel": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "fsdp-dp2": {"parallel.dp": 2, "parallel.dp_mode": "fsdp"},
    "dp2-tp2-pp2": {"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b"},
    "pp2-zbv-full-recompute": {"parallel.pp": 2, "parallel.schedule": "zbv", "recompute": "full"},
    # context parallel: each rank half of every row's positions, whole documents inside attention
    "cp2-pp2": {"parallel.cp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b"},
}

# LoRA (peft's adapters on every linear layer) on the packed conversations, dp2 x pp2
LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.lora.target_modules": "all-linear"}
LORA_RUNS = {"lora-dp2-pp2": {**LORA, "parallel.dp": 2, "parallel.pp": 2, "train.steps": 2, "checkpoint.interval": 0}}

# pipeline, 3 steps: bf16 autocast and fp16 with its GradScaler (the loss's grad_scale path)
LOW_PRECISION = {
    p: {"parallel.pp": 2, "precision": p, "train.steps": 3, "checkpoint.interval": 0} for p in ("bf16", "fp16")
}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA) whose folder holds a chat tokenizer and template, and conversations
    prepared with it and another template, TEMPLATE (lengths 32 .. 128 tokens: two or three a
    packed row)."""
    root = tmp_path_factory.mktemp("sft")
    model = make_model("llama", root / "model", vocab_size=512, max_position_embeddings=SEQ_LEN)
    write_chat_tokenizer(model)
    source = root / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(60)))
    (root / "template.jinja").write_text(TEMPLATE)
    args = ["prepare-data", "--chat", "--source", source, "--tokenizer", model, "--max-len", SEQ_LEN]
    args += ["--chat-template", root / "template.jinja"]
    meshrun_in_process([*args, "--out", root / "data"], tmp_path=root)
    return root


def sft_args(root: Path, run: Path | str, **overrides: object) -> list[str]:
    return tiny(root / "data", run, **{**BASE, "model.hf": root / "model", **overrides})


@pytest.fixture(scope="module")
def runs(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`runs(layout)`: a 10-step run on the conversations, trained on first use."""
    root, done = tmp_path_factory.mktemp("sft-runs"), {}

    def get(layout: str) -> Path:
        if layout not in done:
            run = root / layout
            train_job(sft_args(chat_model, run, **{**LAYOUTS, **LOW_PRECISION, **LORA_RUNS}[layout]), tmp_path=root)
            done[layout] = run
        return done[layout]

    return get


def reference_step(root: Path, model: torch.nn.Module | None = None) -> tuple[float, float]:
    """Step 1 in plain transformers: every conversation of the first global batch's rows run alone
    through LlamaForCausalLM with labels -100 where the loss mask is off, its loss summed over the
    batch's trained tokens (`num_items_in_batch`: one token mean over the global batch), one backward.
    `model`: another model than the folder's (peft's over it); the norm is over what has gradients."""
    cfg = config_from_set_args(sft_args(root, "unused"))
    data = PackedDataset(root / "data", "train", seq_len=SEQ_LEN, seed=cfg.train.seed)
    docs = [int(d) for row in data.rows(0, cfg.train.global_batch) for d in row.docs]
    samples = [data.docs.document(k) for k in docs]
    trained = sum(int(mask[1:].sum()) for _, mask in samples)
    assert len(docs) > cfg.train.global_batch, "rows must hold several conversations for packing to be tested"
    model = (model or load_reference(root / "model")).train()
    total = 0.0
    for ids, mask in samples:
        ids_t = torch.from_numpy(ids)[None]
        labels = torch.where(torch.from_numpy(mask)[None], ids_t, torch.tensor(-100))
        loss = model(input_ids=ids_t, labels=labels, num_items_in_batch=trained).loss
        loss.backward()
        total += loss.item()
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    ).item()
    return total, norm


@pytest.fixture(scope="module")
def reference(chat_model: Path) -> tuple[float, float]:
    """reference_step of the folder's model, computed once for every test that compares with it."""
    return reference_step(chat_model)


def lora_reference_step(root: Path) -> tuple[float, float]:
    """reference_step on peft's LoraConfig over transformers' model, with the adapters meshrun draws
    (per parameter name) copied in: B starts at zero, so the norm is B's gradients, which read A."""
    from meshrun.parallel.materialise import materialise_part

    cfg = config_from_set_args(sft_args(root, "unused", **LORA))
    ours = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    return reference_step(root, peft_model_with(ours, cfg, root / "model"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_step_equals_conversations_alone(layout: str, runs, reference: tuple[float, float]) -> None:
    loss, grad_norm = reference
    first = read_metrics(runs(layout))[0]
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert 0.0 < first["padding"] < 0.5 and first["trained_tokens_per_s"] < first["tokens_per_s"]


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "one-process"])
def test_layout_weights_equal_one_process(layout: str, runs) -> None:
    """After 10 clipped AdamW steps (clipping active at step 1)."""
    one, ours = runs("one-process"), runs(layout)
    assert read_metrics(one)[0]["grad_norm"] > BASE["train.grad_clip"]
    assert max_weight_diff(final_weights(ours), final_weights(one)) < 1e-5


def test_lora_on_packed_conversations_equals_peft_on_each_alone(runs, chat_model: Path) -> None:
    """LoRA on the SFT data (issue: adapters on packed documents): dp2 x pp2's step 1 equals peft
    over transformers' model with each conversation of the global batch run alone."""
    loss, grad_norm = lora_reference_step(chat_model)
    first = read_metrics(runs("lora-dp2-pp2"))[0]
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert grad_norm > 0.0


def test_leaky_rows_differ(chat_model: Path, reference: tuple[float, float]) -> None:
    """The comparison can fail: the same packed rows with attention across documents (ids alone:
    plain causal attention over the row) give another loss than with the documents kept apart."""
    from meshrun.parallel.materialise import materialise_part
    from meshrun.training.loss import MicrobatchLoss

    cfg = config_from_set_args(sft_args(chat_model, "unused"))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    data = PackedDataset(chat_model / "data", "train", seq_len=SEQ_LEN, seed=cfg.train.seed)
    x, y = data.batch(0, cfg.train.global_batch)
    loss = MicrobatchLoss.for_batch(1, target_tokens=data.target_tokens(0, cfg.train.global_batch), dp=1)
    kept, leaky = loss(model(x), y).item(), loss(model(x[:, 0]), y).item()
    assert kept == pytest.approx(reference[0], rel=1e-5)
    assert abs(leaky - kept) > 10 * 1e-5 * kept, "a leak must show beyond the proofs' tolerance"


@pytest.mark.parametrize("family", ["gpt", "gpt2"])
def test_other_families_keep_documents_apart(family: str, tmp_path: Path) -> None:
    """The built-in GPT (learned positions, its own attention) and GPT-2 (transformers' layers,
    learned positions): a packed row's logits equal each document's run alone."""
    from meshrun.parallel.materialise import materialise_part

    if family == "gpt":
        sizes = {"model.vocab_size": 256, "model.num_layers": 2, "model.dim": 32, "model.num_heads": 2}
    else:
        sizes = {"model.hf": make_model("gpt2", tmp_path / "gpt2")}
    cfg = config_from_set_args(tiny(tmp_path, tmp_path / "run", **sizes))
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True).eval()
    lengths = [[5, 7, 4], [16], [3, 3, 3, 7]]
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    packed = model(torch.stack([ids, positions], dim=1))
    for r, row in enumerate(lengths):
        for start, n in zip(np.cumsum([0, *row[:-1]]), row):
            alone = model(ids[r : r + 1, start : start + n])[0]
            torch.testing.assert_close(packed[r, start : start + n], alone, rtol=1e-5, atol=1e-5)


def test_rows_hold_whole_documents_and_their_masked_targets(chat_model: Path) -> None:
    """Every document sits whole in one row; the targets are its next tokens where trained; the
    padding tail trains nothing; data.packing false holds one document a row."""
    for packing in (True, False):
        data = PackedDataset(chat_model / "data", "train", seq_len=SEQ_LEN, seed=0, packing=packing)
        n = data.docs.num_documents
        x, y = data.batch(0, n if not packing else 30)
        seen = []
        for r, row in enumerate(data.rows(0, len(x))):
            assert packing or len(row.docs) == 1
            at = 0
            for doc, length in zip(row.docs.tolist(), row.lengths.tolist()):
                ids, mask = data.docs.document(doc)
                assert torch.equal(x[r, 0, at : at + length], torch.from_numpy(ids))
                assert torch.equal(x[r, 1, at : at + length], torch.arange(length))
                want = torch.from_numpy(np.where(mask[1:], ids[1:], IGNORE))
                assert torch.equal(y[r, at : at + length - 1], want) and y[r, at + length - 1] == IGNORE
                at += length
                seen.append(doc)
            assert (y[r, at:] == IGNORE).all()
        if not packing:
            assert sorted(seen) == list(range(n)), "one epoch is every document once"


def test_resume_and_resharded_resume_continue_the_rows(runs, chat_model: Path, tmp_path: Path) -> None:
    """One process stopped after step 5, continued as dp2 x pp2: the same weights as the
    uninterrupted run (1e-5), so the data position resumed on the same rows."""
    run = interrupted(runs("one-process"), tmp_path / "run", at_step=5)
    result = run_meshrun(["train", *sft_args(chat_model, run, **LAYOUTS["dp2-pp2-1f1b"])], tmp_path=tmp_path)
    assert "resumed from" in result.stderr
    assert max_weight_diff(final_weights(run), final_weights(runs("one-process"))) < 1e-5


@pytest.mark.parametrize("packing", [True, False])
def test_plan_states_the_rows_and_what_they_train(packing: bool, chat_model: Path, tmp_path: Path) -> None:
    """`meshrun plan` of an SFT config plans it and says what a step holds: trained tokens per
    step, padding and the attention length it prices, each equal to a count made here from the
    dataset's own files (meta.json's counts, the document starts, the packer), not from the rows
    training reads. Every conversation here is one block (under 1024 documents)."""
    from meshrun.data.packing import pack

    meta = json.loads((chat_model / "data" / "meta.json").read_text())["splits"]["train"]
    starts = np.fromfile(chat_model / "data" / meta["documents_file"], dtype="<u8").astype(np.int64)
    lengths = np.diff(np.append(starts, meta["tokens"]))
    rows = [r.lengths for r in pack(lengths, SEQ_LEN)] if packing else [np.array([n]) for n in lengths]
    assert len(lengths) < 1024
    pads = [SEQ_LEN - int(r.sum()) for r in rows]
    positions = len(rows) * SEQ_LEN
    # the first token of a conversation (<|im_start|>) is never trained: every trained token is a target
    trained_per_step = BASE["train.global_batch"] * meta["trained_tokens"] / len(rows)
    attention = round((sum(int((r**2).sum()) for r in rows) + sum(p * p for p in pads)) / positions)
    args = [*sft_args(chat_model, tmp_path / "run", **{"data.packing": packing}), "--gpus=1", "--gpu=h100", "--top=1"]
    out = meshrun_in_process(["plan", *args], tmp_path=tmp_path).stdout
    arranged = "packed whole (best-fit decreasing)" if packing else "one document a row, padded"
    assert f"rows of model.seq_len {SEQ_LEN}, {arranged}" in out
    stated = re.search(r"~(\d+) trained tokens \(([\d.]+)% of positions\), padding ([\d.]+)%", out)
    assert stated, out
    assert int(stated[1]) == round(trained_per_step)
    assert float(stated[3]) == pytest.approx(100 * sum(pads) / positions, abs=0.05)
    assert f"attention priced at length {attention} of {SEQ_LEN}" in out
    assert attention < SEQ_LEN


def test_plan_of_a_packed_run_prices_its_rows(runs, tmp_path: Path) -> None:
    """`plan --run` of a finished packed run prices its prediction as the plan does (attention at
    the documents' length) and says so; the same run with its data gone is priced at full rows."""
    import shutil

    def plan_run(run: Path) -> str:
        return meshrun_in_process(["plan", "--run", run, "--gpu", "h100"], tmp_path=tmp_path).stdout

    assert re.search(rf"attention priced at length \d+ of {SEQ_LEN}", plan_run(runs("one-process")))
    elsewhere = shutil.copytree(runs("one-process"), tmp_path / "moved")
    config = json.loads((elsewhere / "config.json").read_text())
    config["data"]["dir"] = str(tmp_path / "gone")
    (elsewhere / "config.json").write_text(json.dumps(config))
    assert "attention priced" not in plan_run(elsewhere)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"model.seq_len": 64}, "documents are longer than model.seq_len 64"),
        ({"model.name": "encdec", "model.vocab_size": 512}, "does not take packed rows"),
        ({"data.dir": "TEXT", "data.packing": True}, "remove data.packing"),
    ],
)
def test_bad_input_is_refused_before_any_worker(
    overrides: dict, message: str, chat_model: Path, data_dir: Path, tmp_path: Path, capsys
) -> None:
    """A document longer than the rows, a model that cannot keep documents apart, data.packing on text."""
    from meshrun.cli import main

    settings = {**BASE, "model.hf": chat_model / "model", **overrides}
    if settings.get("model.name") == "encdec":
        del settings["model.hf"]
    settings = {k: data_dir if v == "TEXT" else v for k, v in settings.items()}
    code = main(["train", "--dry-run", *tiny(chat_model / "data", tmp_path / "run", **settings)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and message in err, err


def test_sample_chat_answers_as_transformers_generate_on_the_export(runs, tmp_path: Path) -> None:
    """`sample --chat` renders the message with the fine-tuning template and stops at the end of
    the turn; `export --hf` carries that template, so transformers' own generate on the exported
    folder (greedy, stopping at EOS) gives the same answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, message = runs("one-process"), "What is 7 plus 1? Answer briefly."
    sampled = meshrun_in_process(
        ["sample", run, "--chat", message, "--temperature", "0", "--tokens", "24"], tmp_path=tmp_path
    )
    meshrun_in_process(["export", run, "--hf", tmp_path / "hf"], tmp_path=tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert TEMPLATE != CHATML and tokenizer.decode(ids[0]).endswith("<|im_start|>assistant:\n")
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id)[
        0, ids.shape[1] :
    ]
    answer = tokenizer.decode(out[:-1] if out[-1] == tokenizer.eos_token_id else out)
    assert sampled.stdout == answer + "\n" and answer.strip()


def test_sample_chat_needs_a_model_fine_tuned_on_conversations(data_dir: Path) -> None:
    from meshrun.errors import ConfigError
    from meshrun.generation.chat import chat_prompt

    with pytest.raises(ConfigError, match="not prepared with prepare-data --chat"):
        chat_prompt(data_dir, "Hello?")


def test_the_shipped_example_prepares_and_plans(tmp_path: Path, capsys) -> None:
    """configs/chat-bytes reads text as its bytes (the ids a byte-level model was pretrained on),
    `prepare-data --chat` without --source builds the example conversations (a name, then its
    CamelCase form, the answer and its end of turn trained), and configs/sft-tiny.yaml plans on them."""
    from meshrun.cli import main
    from meshrun.data.documents import open_documents

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "camel-chats"
    assert (
        main(
            [
                "prepare-data",
                "--chat",
                "--tokenizer",
                str(repo / "configs/chat-bytes"),
                "--max-len",
                "128",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    docs = open_documents(out, "train")
    assert docs.num_documents > 1000
    for k in range(0, docs.num_documents, 97):
        ids, mask = docs.document(k)
        text = bytes(i for i in ids.tolist() if i < 256).decode()
        name = text.split("user\n")[1].split("\n")[0]
        camel = "".join(word.capitalize() for word in name.split("_"))
        assert ids[mask].tolist() == [*camel.encode(), 257], text  # the answer, then <|im_end|>
    base = make_model("llama", tmp_path / "base", vocab_size=258, max_position_embeddings=SEQ_LEN)
    capsys.readouterr()
    args = ["train", str(repo / "configs/sft-tiny.yaml"), "--dry-run", "--set", f"model.hf={base}"]
    assert main([*args, "--set", f"data.dir={out}", "--set", f"run_dir={tmp_path / 'run'}"]) == 0, (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("precision", list(LOW_PRECISION))
def test_low_precision_packed_step(precision: str, runs, reference: tuple[float, float]) -> None:
    """bf16 and fp16 autocast over packed rows under a pipeline: step 1 within 1% of the fp32
    reference (half-precision matmuls carry 8 or 11 mantissa bits, ~0.4% or 0.05% per product; the
    loss, a mean of thousands of them, lands well inside 1%; the gradient norm inside 5%), and the
    run trains on."""
    loss, grad_norm = reference
    rows = read_metrics(runs(precision))
    assert rows[0]["loss"] == pytest.approx(loss, rel=1e-2)
    assert rows[0]["grad_norm"] == pytest.approx(grad_norm, rel=5e-2)
    assert len([r for r in rows if "loss" in r]) == 3
