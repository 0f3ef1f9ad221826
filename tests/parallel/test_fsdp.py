"""FSDP2 / HSDP (parallel.dp_mode) numerics, resume across data-parallel modes, and memory.

Every row runs the real CLI under torchrun (gloo, CPU) for 10 steps with recompute and
accumulation, and compares the final weights (loaded on one process) with one meshrun process
on the same global batch, and every step's pre-clip grad_norm with the plain-torch reference.
The rows also write a checkpoint at step 5: the resume matrix continues those runs in another
mode and layout from there, so it costs only the second halves.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
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
from plain_reference import assert_grad_norms_match
from test_checkpoint import interrupted_copy

# Accumulation: global 16 / micro 2 = 8 microbatches in one process, 4 per rank at dp 2, 2 at dp 4.
# lr/clip chosen so clipping is active every step (a wrong scale would show in the weights too).
BASE = {"train.global_batch": 16, "train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5, "checkpoint.interval": 5}

ROWS = {
    "fsdp-dp2-pp1": {"parallel.dp": 2, "parallel.dp_mode": "fsdp", "recompute": "full"},
    "fsdp-dp2-pp2-1f1b": {
        "parallel.dp": 2,
        "parallel.pp": 2,
        "parallel.dp_mode": "fsdp",
        "parallel.schedule": "1f1b",
        "recompute": "every:2",
    },
    "hsdp-2x2-pp1": {"parallel.dp": 4, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 2, "recompute": "selective"},
    "fsdp-dp2-pp2-zero-bubble": {
        "parallel.dp": 2,
        "parallel.pp": 2,
        "parallel.dp_mode": "fsdp",
        "parallel.schedule": "zero-bubble",
    },  # refused under ddp (its hooks are bypassed)
    "ddp-dp2-pp1": {"parallel.dp": 2},  # the resume source and the memory baseline
}


def train(data_dir: Path, run: Path, **overrides: object) -> Path:
    train_job(tiny(data_dir, run, **{**BASE, **overrides}), tmp_path=run.parent, timeout=420)
    return run


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, the same 8 microbatches of 2: only the spreading over ranks differs."""
    return train(data_dir, tmp_path_factory.mktemp("fsdp-ref") / "run")


@pytest.fixture(scope="module")
def rows(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`rows(name)`: that row's finished run, trained the first time a test asks for it."""
    tmp, done = tmp_path_factory.mktemp("fsdp-rows"), {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train(data_dir, tmp / name, **ROWS[name])
        return done[name]

    return get


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", [r for r in ROWS if not r.startswith("ddp")])
def test_sharded_layout_matches_one_process(row: str, rows, reference: Path, plain_reference) -> None:
    run = rows(row)
    assert min(grad_norms(run)) > 0.5, "clipping must be active for the test to mean anything"
    assert_grad_norms_match(grad_norms(run), plain_reference(**BASE).grad_norms)
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-5
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)


RESUMES = [  # (written by, resumed as)
    ("ddp-dp2-pp1", {"parallel.dp": 2, "parallel.dp_mode": "fsdp"}),
    ("fsdp-dp2-pp1", {"parallel.dp": 2, "parallel.dp_mode": "ddp"}),
    ("fsdp-dp2-pp2-1f1b", {"parallel.dp": 4, "parallel.pp": 1, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 2}),
]


@pytest.mark.timeout(900)  # may train its source row too (2 runs); generous for loaded machines
@pytest.mark.parametrize("source,resumed_as", RESUMES, ids=["ddp-to-fsdp", "fsdp-to-ddp", "fsdp-dp2xpp2-to-hsdp-dp4"])
def test_resume_in_another_data_parallel_mode(
    source: str, resumed_as: dict, rows, reference: Path, data_dir: Path, tmp_path: Path
) -> None:
    """Checkpoints are layout-free: the second half in another mode continues the same run."""
    run = interrupted_copy(rows(source), tmp_path / "run", at_step=5)
    train(data_dir, run, **{**ROWS[source], "parallel.pp": 1, **resumed_as})
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 11))
    assert max_weight_diff(final_weights(run), final_weights(rows(source))) < 1e-5
    assert max_weight_diff(final_weights(run), final_weights(reference)) < 1e-5
    assert losses(run)[5:] == pytest.approx(losses(rows(source))[5:], abs=1e-5)


@pytest.mark.timeout(900)
def test_fsdp_holds_about_half_of_ddps_training_state(rows) -> None:
    """Params + grads + AdamW moments on the largest rank, measured after the first step."""
    fsdp, ddp = (read_metrics(rows(name))[0]["state_bytes"] for name in ("fsdp-dp2-pp1", "ddp-dp2-pp1"))
    assert ddp > 0 and fsdp <= 0.55 * ddp, (fsdp, ddp)


def test_dry_run_shows_the_data_mesh_and_per_rank_bytes(data_dir: Path, tmp_path: Path) -> None:
    """Estimated from the meta model: fsdp over 2 ranks holds half of ddp's bytes per rank."""

    def per_rank_lines(**overrides: object) -> list[str]:
        args = ["train", "--dry-run", *tiny(data_dir, tmp_path / "run", **{"train.global_batch": 16, **overrides})]
        out = run_meshrun(args, tmp_path=tmp_path).stdout
        return out.split("\ndata parallel:\n")[1].split("\nprecision:")[0].splitlines()

    ddp = per_rank_lines(**{"parallel.dp": 2})
    hsdp = per_rank_lines(**{"parallel.dp": 4, "parallel.pp": 2, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 2})
    assert "ddp: 2 full replicas per stage (shard 1 x replicate 2)" in ddp[0]
    assert "hsdp: shard 2 x replicate 2" in hsdp[0]
    assert "reshard after forward: False" in hsdp[1]  # the default under pipelining
    assert [line.split(":")[0] for line in hsdp[2:]] == ["  pipeline rank 0", "  pipeline rank 1"]

    def total_mib(line: str) -> float:
        return float(line.rsplit("= ", 1)[1].removesuffix(" MiB"))

    whole = total_mib(ddp[1])
    assert whole > 0 and total_mib(hsdp[2]) + total_mib(hsdp[3]) == pytest.approx(whole / 2, abs=0.02)


def test_hsdp_needs_a_shard_size_that_divides_dp(data_dir: Path, tmp_path: Path) -> None:
    args = [
        "train",
        *tiny(data_dir, tmp_path / "run", **{"parallel.dp": 4, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 3}),
    ]
    result = meshrun_in_process(args, tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and "parallel.dp_shard" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "run").exists()
