"""Context parallelism (parallel.cp) against one process, fp32, gloo, real torchrun.

Each row trains 10 clipped AdamW steps on the plain byte corpus and logs every step's loss and
pre-clip gradient norm as the independent plain-torch reference computes them (1e-5 relative);
its weights after the last step equal meshrun's one-process run (1e-5). Rows: cp2 (DDP over the
cp ranks), fsdp dp2 x cp2 under full recompute, tp2 x cp2 under sequence parallel. A rank whose positions
were rotated by the wrong offset, or whose attention saw only its own chunk, moves the loss.
Llama under cp is proven in tests/models/test_hf.py (plain text, cp2 resumed at cp1) and
tests/models/test_sft.py (packed conversations, cp2 x pp2); GPT on packed documents, the
all-to-alls themselves, and two broken variants, in test_context_attention.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import final_weights, grad_norms, losses, max_weight_diff, read_metrics, run_meshrun, tiny
from plain_reference import assert_grad_norms_match

BASE = {"train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5, "checkpoint.interval": 5}
ROWS = {
    "cp2": {"parallel.cp": 2},  # DDP over the cp ranks (each holds a part of the same samples)
    # 4 ranks: FSDP2 shards over dp x cp (dp_shard_cp, as torchtitan), under full recompute
    "fsdp-dp2-cp2": {"parallel.dp": 2, "parallel.cp": 2, "parallel.dp_mode": "fsdp", "recompute": "full"},
    # 4 ranks: heads split by tp, then by cp (4 heads: one a rank inside attention); sequence parallel
    # holds T / (cp x tp) positions a rank outside attention. Against the reference only (4 heads).
    "tp2-sp-cp2": {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.cp": 2, "model.num_heads": 4},
}
MODEL_KEYS = {"model.num_heads"}  # a row's keys that change the maths, not only the layout


def train(data_dir: Path, run: Path, **overrides: object) -> Path:
    run_meshrun(["train", *tiny(data_dir, run, **{**BASE, **overrides})], tmp_path=run.parent, timeout=420)
    return run


@pytest.fixture(scope="module")
def one_process(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(data_dir, tmp_path_factory.mktemp("cp-ref") / "run")


@pytest.fixture(scope="module")
def rows(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`rows(name)`: that row's finished run, trained the first time a test asks for it."""
    tmp, done = tmp_path_factory.mktemp("cp-rows"), {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train(data_dir, tmp / name, **ROWS[name])
        return done[name]

    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", list(ROWS))
def test_context_parallel_matches_plain_torch(row: str, rows, plain_reference) -> None:
    run, want = rows(row), plain_reference(**BASE, **{k: v for k, v in ROWS[row].items() if k in MODEL_KEYS})
    assert min(grad_norms(run)) > 0.5, "clipping must be active for the test to mean anything"
    assert losses(run)[0] == pytest.approx(want.losses[0], rel=1e-5)
    assert_grad_norms_match(grad_norms(run), want.grad_norms)
    assert losses(run) == pytest.approx(want.losses, rel=1e-5)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", [row for row, keys in ROWS.items() if not MODEL_KEYS & keys.keys()])
def test_context_parallel_equals_one_process(row: str, rows, one_process: Path) -> None:
    """The weights after 10 clipped steps (1e-5); tokens/s and TFLOP/s count each token once, and
    attention over the whole sequence, as one process does."""
    run = rows(row)
    assert max_weight_diff(final_weights(run), final_weights(one_process)) < 1e-5
    steps = [[r for r in read_metrics(run_dir) if "tokens_per_s" in r] for run_dir in (run, one_process)]
    assert len(steps[0]) == len(steps[1]) == BASE["train.steps"]
    for ours, one in zip(*steps):
        for key in ("tokens_per_s", "tflops"):
            assert ours[key] * ours["step_time_s"] == pytest.approx(one[key] * one["step_time_s"], rel=1e-9)
