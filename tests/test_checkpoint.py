"""Checkpoints: exact resume, resharding, corrupt files, interrupted saves, export and sample.

An interruption after step 4 is reproduced exactly by removing a finished run's later
checkpoints: what remains is what a run killed between steps 4 and 8 leaves behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    final_weights,
    losses,
    max_weight_diff,
    meshrun_in_process,
    read_metrics,
    run_meshrun,
    tiny,
    train_job,
)
from safetensors.torch import load_file


def layout(dp: int, pp: int) -> dict[str, object]:
    return {"parallel.dp": dp, "parallel.pp": pp}


STEPS = {"train.steps": 12, "checkpoint.interval": 4, "checkpoint.keep": 3, "train.lr": 3e-3}


def train(data_dir: Path, run: Path, *, check: bool = True, **overrides: object):
    return train_job(tiny(data_dir, run, **{**STEPS, **overrides}), tmp_path=run.parent, check=check)


def interrupted_copy(run: Path, dest: Path, *, at_step: int) -> Path:
    """The run as it stood when killed after `at_step`: later checkpoints gone, a save half-written."""
    shutil.copytree(run, dest)
    root = dest / "checkpoints"
    for folder in root.glob("step-*"):
        if int(folder.name.split("-")[1]) > at_step:
            shutil.rmtree(folder)
    half = root / f"step-{at_step + 4:08d}.tmp"  # a save killed mid-write: no manifest
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"\0" * 100)
    (root / "latest").write_text(f"step-{at_step:08d}\n")
    (dest / "summary.json").unlink()
    return dest


@pytest.fixture(scope="module")
def full_runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted 12-step runs: dp2 x pp2 in fp32, dp1 x pp2 in bf16, dp2 x pp1 with dropout."""
    tmp = tmp_path_factory.mktemp("full")
    return {name: train(data_dir, tmp / name, **overrides) and tmp / name for name, overrides in VARIANTS.items()}


VARIANTS = {
    "fp32": layout(2, 2),
    "bf16": {**layout(1, 2), "precision": "bf16"},
    "dropout": {**layout(2, 1), "model.dropout": 0.1},  # needs the per-rank RNG state restored
}


@pytest.mark.parametrize("variant", ["bf16", "dropout"])  # fp32: test_corrupt_checkpoint_falls_back_with_a_warning
def test_resume_is_bit_identical(variant: str, full_runs, data_dir: Path, tmp_path: Path) -> None:
    full = full_runs[variant]
    run = interrupted_copy(full, tmp_path / "run", at_step=4)
    result = train(data_dir, run, **VARIANTS[variant])
    assert "resumed from" in result.stderr and "step 4" in result.stderr
    resumed, reference = final_weights(run), final_weights(full)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    assert losses(run) == losses(full)  # every step logged once, values identical
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 13))
    assert not (run / "checkpoints" / "step-00000008.tmp").exists()  # the half-written save was cleared


@pytest.mark.parametrize("dp,pp", [(1, 4), (4, 1), (1, 1)])
def test_resharded_resume_continues_the_same_run(dp, pp, full_runs, data_dir: Path, tmp_path: Path) -> None:
    """Written as dp2 x pp2, resumed as another layout: same data position, same parameters."""
    full = full_runs["fp32"]
    run = interrupted_copy(full, tmp_path / "run", at_step=4)
    train(data_dir, run, **layout(dp, pp))
    assert max_weight_diff(final_weights(run), final_weights(full)) < 1e-5
    assert losses(run) == pytest.approx(losses(full), abs=1e-5)
    config = json.loads((run / "config.json").read_text())
    assert (config["parallel"]["dp"], config["parallel"]["pp"]) == (dp, pp)


def test_corrupt_checkpoint_falls_back_with_a_warning(full_runs, data_dir: Path, tmp_path: Path) -> None:
    """Step 8 truncated, step 12 half-written: the fp32 dp2 x pp2 run resumes from step 4 and ends
    bit-identical to the uninterrupted one (the fp32 row of test_resume_is_bit_identical)."""
    full = full_runs["fp32"]
    run = interrupted_copy(full, tmp_path / "run", at_step=8)
    shard = run / "checkpoints" / "step-00000008" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    result = train(data_dir, run, **layout(2, 2))
    assert "__1_0.distcp is truncated" in result.stderr and "trying an older checkpoint" in result.stderr
    assert "resumed from" in result.stderr and "step-00000004" in result.stderr
    resumed, reference = final_weights(run), final_weights(full)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    assert losses(run) == losses(full)  # every step logged once, values identical
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 13))
    assert not (run / "checkpoints" / "step-00000012.tmp").exists()  # the half-written save was cleared


def test_explicit_corrupt_checkpoint_is_a_clear_error(full_runs, data_dir: Path, tmp_path: Path) -> None:
    full = full_runs["fp32"]
    run = interrupted_copy(full, tmp_path / "run", at_step=8)
    ckpt = run / "checkpoints" / "step-00000008"
    meta = ckpt / ".metadata"
    meta.write_bytes(b"garbage" + meta.read_bytes()[7:])  # same size, different bytes
    before = {str(p.relative_to(ckpt)): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    result = train(data_dir, run, check=False, **layout(2, 2), **{"train.resume": ckpt})
    assert result.returncode != 0
    assert f"{meta} is corrupt" in result.stderr
    assert {str(p.relative_to(ckpt)): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before  # unchanged


def test_metadata_is_never_unpickled_freely(full_runs, tmp_path: Path) -> None:
    """A .metadata that would run code on load is refused (the manifest is forged to match)."""
    import pickle

    from meshrun.checkpoint.dcp import _crc32, full_model_state
    from meshrun.errors import CheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(full_runs["fp32"] / "checkpoints" / "step-00000012", ckpt)
    evil = pickle.dumps(type("Evil", (), {"__reduce__": lambda self: (print, ("pwned",))})())
    (ckpt / ".metadata").write_bytes(evil)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": len(evil), "crc32": _crc32(ckpt / ".metadata")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"refusing to load builtins\.print"):
        full_model_state(torch.nn.Linear(1, 1), ckpt)


def test_export_and_sample_round_trip(full_runs, tmp_path: Path) -> None:
    run = full_runs["fp32"]
    out = tmp_path / "model.safetensors"
    meshrun_in_process(["export", run, "--out", out], tmp_path=tmp_path)
    exported = load_file(out)
    reference = final_weights(run)
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
    pt = tmp_path / "model.pt"
    meshrun_in_process(["export", run / "checkpoints" / "step-00000012", "--out", pt], tmp_path=tmp_path)
    plain = torch.load(pt, weights_only=True)
    assert all(torch.equal(plain["model"][k], reference[k]) for k in reference)
    again = meshrun_in_process(["export", run, "--out", out], tmp_path=tmp_path, check=False)
    assert again.returncode == 2 and "already exists" in again.stderr
    sample = ["sample", str(run), "--prompt", "def ", "--tokens", "30", "--seed", "3"]
    a = run_meshrun(sample, tmp_path=tmp_path).stdout  # a process of its own, then this one: the seed decides
    b = meshrun_in_process(sample, tmp_path=tmp_path).stdout
    assert a == b and a.startswith("def ") and len(a.rstrip("\n").encode()) >= 30


def test_resumed_run_continues_the_same_wandb_run(data_dir: Path, tmp_path: Path) -> None:
    from wandb_files import offline_runs, read_run

    run = tmp_path / "run"
    wandb = {"tracker.mode": "offline", "train.steps": 8}
    train(data_dir, run, **wandb, **{"checkpoint.interval": 4})
    shutil.rmtree(run / "checkpoints" / "step-00000008")
    (run / "summary.json").unlink()
    train(data_dir, run, **wandb, **{"checkpoint.interval": 4})
    first, second = (read_run(r) for r in offline_runs(run))
    assert first.run_id == second.run_id == (run / "wandb_run_id").read_text().strip()
    assert [r["_step"] for r in second.history if "loss" in r] == [5, 6, 7, 8]


def test_ctrl_c_caught_by_dcp_mid_save_is_an_interrupt(tmp_path: Path) -> None:
    """One process (SIGINT is Python's there): a Ctrl-C inside DCP's save came back wrapped in a
    CheckpointException, which ended the run as a failure (exit 1, a traceback). The partial save
    goes and the interrupt goes on as one (exit 130, one line)."""
    import traceback

    from torch.distributed.checkpoint import CheckpointException

    from meshrun.checkpoint.dcp import failed_save

    tmp = tmp_path / "checkpoints" / "step-00000003.tmp"
    tmp.mkdir(parents=True)
    wrapped = CheckpointException("save failed", {0: (KeyboardInterrupt(), traceback.StackSummary())})
    assert isinstance(failed_save(wrapped, tmp), KeyboardInterrupt)
    assert not tmp.exists()
