"""Context parallelism (parallel.cp) against the plain-torch reference, fp32, gloo, real torchrun.

Each row trains 10 clipped AdamW steps and logs every step's loss and pre-clip gradient norm as
the independent plain-torch reference (plain_reference.py) computes them (1e-5 relative, step 1
first); its weights after the last step equal the reference's (1e-5).
- Plain text: cp2 (DDP over the cp ranks), fsdp dp2 x cp2 under full recompute, HSDP dp4 x cp2
  (8 ranks: each replica sharded over dp_shard x cp), cp2 x pp2 under
  interleaved 1F1B, GPipe (blocks alternately recomputed and offloaded) and zero-bubble (DDP over
  the cp pair with a split backward: parallel/pipeline.py averages its gradients).
- Packed documents with per-document masks (prompt/completion documents, two a row, crossing the
  cp chunk boundary; the reference runs each document alone): cp2 x pp2 under looped BFS, tp2 x cp2
  under sequence parallel, and the one 8-rank row, fsdp dp2 x cp2 x pp2 under ZBV (each backward
  split in two passes).
Every schedule runs under cp: 1F1B in tests/models/test_sft.py (Llama, packed conversations), the
five others here; each new row of these was seen failing with the second all-to-all returning
positions to the wrong rank, and with positions taken as local.
The cp2 run's step-5 checkpoint resumed at dp2 ends where it does. Llama under cp is proven in
tests/models/test_hf.py (plain text, cp2 resumed at cp1) and tests/models/test_sft.py (packed
conversations, cp2 x pp2); the all-to-alls themselves, and two broken variants (positions taken
as local, the second all-to-all to the wrong rank) differing at step 1 on both kinds of data, in
test_context_attention.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from chat_data import write_chat_tokenizer
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
from plain_reference import Reference, assert_grad_norms_match, config_from_set_args, train_plain
from test_checkpoint import interrupted_copy

BASE = {"train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5, "checkpoint.interval": 5}
DOCUMENTS = {"model.seq_len": 32, "model.vocab_size": 512}  # and data.dir: the documents folder
ROWS = {
    "cp2": {"parallel.cp": 2},  # DDP over the cp ranks (each holds a part of the same samples)
    # 4 ranks: FSDP2 shards over dp x cp (dp_shard_cp, as torchtitan), under full recompute
    "fsdp-dp2-cp2": {"parallel.dp": 2, "parallel.cp": 2, "parallel.dp_mode": "fsdp", "recompute": "full"},
    # 8 ranks: HSDP, each replica sharded over its dp_shard x cp ranks (2 x 2), 2 replicas
    "hsdp-dp4-cp2": {"parallel.dp": 4, "parallel.cp": 2, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 2},
    # 4 ranks: each stage's attention split over its cp pair (two stages a rank); positions travel
    # between the stages
    "cp2-pp2": {"parallel.cp": 2, "parallel.pp": 2, "parallel.schedule": "interleaved-1f1b"},
    # 4 ranks, the other schedules of cp2 x pp2 (1F1B: tests/models/test_sft.py; ZBV: the 8-rank row):
    # GPipe with its blocks alternately recomputed and offloaded (train.offload_activations beside
    # recompute under cp), zero-bubble's split backward (weight gradients apart from DDP's hooks),
    # looped BFS on packed documents
    "cp2-pp2-gpipe": {
        "parallel.cp": 2,
        "parallel.pp": 2,
        "parallel.schedule": "gpipe",
        "recompute": "every:2",
        "train.offload_activations": True,
    },
    "cp2-pp2-zero-bubble": {"parallel.cp": 2, "parallel.pp": 2, "parallel.schedule": "zero-bubble"},
    "cp2-pp2-looped-bfs-documents": {
        **DOCUMENTS,
        "parallel.cp": 2,
        "parallel.pp": 2,
        "parallel.schedule": "looped-bfs",
    },
    # 4 ranks: heads split by tp, then by cp (4 heads: one a rank inside attention); sequence parallel
    # holds T / (cp x tp) positions a rank outside attention
    "tp2-sp-cp2-documents": {
        **DOCUMENTS,
        "parallel.tp": 2,
        "parallel.sequence_parallel": True,
        "parallel.cp": 2,
        "model.num_heads": 4,
    },
    # the one 8-rank row: every axis that splits a sample or the batch, on packed documents; each
    # stage's FSDP2 shards over its dp x cp ranks (cp2-pp2 above: DDP over the cp pair)
    "dp2-cp2-pp2-documents": {
        **DOCUMENTS,
        "parallel.dp": 2,
        "parallel.cp": 2,
        "parallel.pp": 2,
        "parallel.dp_mode": "fsdp",
        "parallel.schedule": "zbv",
    },
}
MATHS_KEYS = {"model.num_heads", *DOCUMENTS}  # a row's keys that change the maths, not only the layout


def train(data_dir: Path, run: Path, **overrides: object) -> Path:
    train_job(tiny(data_dir, run, **{**BASE, **overrides}), tmp_path=run.parent, timeout=420)
    return run


@pytest.fixture(scope="module")
def documents_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """120 prompt/completion documents of 10 to 19 tokens, prepared with a chat tokenizer (vocab 344)."""
    root = tmp_path_factory.mktemp("cp-documents")
    records = [{"q": f"{i} plus {i % 7}?", "a": f" It is {i + i % 7}." + " Indeed." * (i % 4)} for i in range(120)]
    (root / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["prepare-data", "--prompt-completion", "--prompt-field", "q", "--completion-field", "a"]
    args += ["--source", root / "pc.jsonl", "--tokenizer", write_chat_tokenizer(root / "tokenizer")]
    meshrun_in_process([*args, "--max-len", str(DOCUMENTS["model.seq_len"]), "--out", root / "data"], tmp_path=root)
    return root / "data"


@pytest.fixture(scope="module")
def data_of(data_dir: Path, documents_dir: Path) -> Callable[[str], Path]:
    """`data_of(row)`: the plain byte corpus, or the documents folder for a row on documents."""
    return lambda row: documents_dir if DOCUMENTS.keys() <= ROWS[row].keys() else data_dir


@pytest.fixture(scope="module")
def reference(data_of: Callable[[str], Path]) -> Callable[[str], Reference]:
    """`reference(row)`: the plain-torch run of that row's maths, computed once per maths."""
    done: dict[str, Reference] = {}

    def get(row: str) -> Reference:
        maths = {k: v for k, v in ROWS[row].items() if k in MATHS_KEYS}
        key = repr(sorted(maths.items()))
        if key not in done:
            cfg = config_from_set_args(tiny(data_of(row), "unused", **{**BASE, **maths}))
            done[key] = train_plain(cfg, data_of(row))
        return done[key]

    return get


@pytest.fixture(scope="module")
def one_process(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(data_dir, tmp_path_factory.mktemp("cp-ref") / "run")


@pytest.fixture(scope="module")
def rows(data_of: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`rows(name)`: that row's finished run, trained the first time a test asks for it."""
    tmp, done = tmp_path_factory.mktemp("cp-rows"), {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train(data_of(name), tmp / name, **ROWS[name])
        return done[name]

    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", list(ROWS))
def test_context_parallel_matches_plain_torch(row: str, rows, reference) -> None:
    """Step 1's loss and pre-clip norm, then every step's, then the weights after 10 clipped steps."""
    run, want = rows(row), reference(row)
    assert min(grad_norms(run)) > 0.5, "clipping must be active for the test to mean anything"
    assert losses(run)[0] == pytest.approx(want.losses[0], rel=1e-5)
    assert grad_norms(run)[0] == pytest.approx(want.grad_norms[0], rel=1e-5)
    assert_grad_norms_match(grad_norms(run), want.grad_norms)
    assert losses(run) == pytest.approx(want.losses, rel=1e-5)
    assert max_weight_diff(final_weights(run), want.weights) < 1e-5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", [row for row, keys in ROWS.items() if not MATHS_KEYS & keys.keys()])
def test_context_parallel_counts_each_token_once(row: str, rows, one_process: Path) -> None:
    """tokens/s and TFLOP/s count each token once, and attention over the whole sequence, as one
    process does."""
    steps = [[r for r in read_metrics(run_dir) if "tokens_per_s" in r] for run_dir in (rows(row), one_process)]
    assert len(steps[0]) == len(steps[1]) == BASE["train.steps"]
    for ours, one in zip(*steps):
        for key in ("tokens_per_s", "tflops"):
            assert ours[key] * ours["step_time_s"] == pytest.approx(one[key] * one["step_time_s"], rel=1e-9)


@pytest.mark.timeout(900)
def test_cp2_checkpoint_resumes_at_dp2(rows, reference, data_dir: Path, tmp_path: Path) -> None:
    """cp2's step-5 checkpoint (cp ranks hold whole replicas) resumed by dp2: steps 6 to 10 and the
    weights after them as the uninterrupted cp2 run and the reference (1e-5)."""
    full = rows("cp2")
    run = interrupted_copy(full, tmp_path / "run", at_step=5)
    done = train_job(tiny(data_dir, run, **{**BASE, "parallel.dp": 2}), tmp_path=tmp_path, timeout=420)
    assert "resumed from" in done.stderr
    assert losses(run)[-5:] == pytest.approx(losses(full)[-5:], rel=1e-5)
    assert losses(run)[-5:] == pytest.approx(reference("cp2").losses[-5:], rel=1e-5)
    assert max_weight_diff(final_weights(run), final_weights(full)) < 1e-5


def test_compile_true_on_documents_is_refused_before_any_worker(documents_dir: Path, tmp_path: Path) -> None:
    """A packed row's attention slices each document on the host, which breaks the one graph per
    block that train.compile true asks for: one line, exit 2, no worker (models/documents.py)."""
    args = tiny(documents_dir, tmp_path / "run", **{**DOCUMENTS, "train.compile": True})
    done = meshrun_in_process(["train", "--dry-run", *args], tmp_path=tmp_path, check=False)
    err = done.stderr.strip()
    assert done.returncode == 2 and err.count("\n") == 0, err
    assert "train.compile true compiles each block as one graph" in err and "set train.compile: auto" in err


def test_sample_reads_a_cp2_checkpoint(rows, one_process: Path, tmp_path: Path) -> None:
    """`meshrun sample` (one process) reads the cp2 run's checkpoint: the same text as the
    one-process run's (weights within 1e-5 of each other, the same seed)."""
    texts = [
        meshrun_in_process(["sample", run, "--tokens", "12", "--seed", "3"], tmp_path=tmp_path).stdout.strip()
        for run in (rows("cp2"), one_process)
    ]
    assert texts[0] and texts[0] == texts[1]


LOW_PRECISION = {
    p: {"parallel.cp": 2, "precision": p, "train.steps": 3, "checkpoint.interval": 0} for p in ("bf16", "fp16")
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", list(LOW_PRECISION))
def test_low_precision_under_cp_tracks_fp32(precision: str, data_dir: Path, reference, tmp_path: Path) -> None:
    """bf16 autocast, and fp16 with its GradScaler, at cp2: step 1 within 1% of the fp32 reference
    (half-precision matmuls carry 8 or 11 mantissa bits, ~0.4% or 0.05% a product; the loss, a mean
    over every position, lands well inside 1%), every step finite, the run trains on."""
    run = train(data_dir, tmp_path / "run", **LOW_PRECISION[precision])
    ours = losses(run)
    assert len(ours) == 3 and all(map(math.isfinite, ours))
    assert ours[0] == pytest.approx(reference("cp2").losses[0], rel=1e-2)
    assert ours[-1] < ours[0]
