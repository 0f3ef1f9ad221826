"""Hugging Face models (built by transformers in the test, saved with save_pretrained) trained by
meshrun: the first step equals plain transformers, dp x pp layouts equal one process, tied copies
stay identical, resume is exact, and the export loads back into transformers."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    final_weights,
    losses,
    max_weight_diff,
    meshrun_in_process,
    read_metrics,
    tiny,
    train_job,
)
from hf_models import SEQ_LEN, load_reference, make_model, reference_loss_and_grad_norm

FAMILIES = ["llama", "gpt2"]
# lr / clip as in tests/parallel: clipping active every step, weights moving visibly in 10 steps.
BASE = {"model.seq_len": SEQ_LEN, "train.global_batch": 16, "train.steps": 10, "train.lr": 3e-3, "train.grad_clip": 0.5}
LAYOUTS = {
    "dp2-pp2-1f1b": {"parallel.dp": 2, "parallel.pp": 2, "parallel.schedule": "1f1b", "recompute": "full"},
    "dp1-pp4-interleaved": {"parallel.pp": 4, "parallel.schedule": "interleaved-1f1b", "recompute": "every:2"},
    # context parallel: half of each sample's positions a rank, rotary at global positions, GQA heads split
    "cp2": {"parallel.cp": 2},
}
# fairscale profiles Llama's blocks standalone (they need rotary embeddings): the measured split
# trains like one process (its own key: a measured split may differ between a run and its resume)
MEASURED = {"dp2-pp2-1f1b-balance-time": {**LAYOUTS["dp2-pp2-1f1b"], "parallel.balance": "time"}}


def hf_train(data_dir: Path, run: Path, model_dir: Path, *, check: bool = True, **overrides: object):
    args = tiny(data_dir, run, **{**BASE, "model.hf": model_dir, **overrides})
    return train_job(args, tmp_path=run.parent, check=check)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llama saved sharded (index json), GPT-2 (tied) as one file."""
    root = tmp_path_factory.mktemp("hf")
    return {family: make_model(family, root / family, shard=family == "llama") for family in FAMILIES}


@pytest.fixture(scope="session")
def runs(hf_dirs, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """`runs(family, layout)`: a 10-step run, trained on first use and shared by every test after."""
    root, done = tmp_path_factory.mktemp("runs"), {}

    def get(family: str, layout: str = "one-process") -> Path:
        if (family, layout) not in done:
            run = root / f"{family}-{layout}"
            hf_train(
                data_dir, run, hf_dirs[family], **{**LAYOUTS, **MEASURED}.get(layout, {}), **{"checkpoint.interval": 5}
            )
            done[family, layout] = run
        return done[family, layout]

    return get


@pytest.fixture(scope="session")
def weights(runs) -> Callable[[str, str], dict]:
    """`weights(family, layout)`: final weights of `runs(family, layout)`, loaded once."""
    loaded: dict[tuple[str, str], dict] = {}

    def get(family: str, layout: str = "one-process") -> dict:
        if (family, layout) not in loaded:
            loaded[family, layout] = final_weights(runs(family, layout))
        return loaded[family, layout]

    return get


def test_hf_models_are_really_sharded_and_tied(hf_dirs) -> None:
    assert (hf_dirs["llama"] / "model.safetensors.index.json").is_file()
    assert load_reference(hf_dirs["gpt2"]).config.tie_word_embeddings


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_equals_transformers(family: str, runs, hf_dirs, data_dir: Path) -> None:
    """Pretrained weights, step 1: meshrun's loss and pre-clip gradient norm = plain transformers'."""
    from meshrun.data.dataset import TokenDataset

    x, y = TokenDataset(data_dir, "train", seq_len=SEQ_LEN, seed=1337).batch(0, 16)
    loss, grad_norm = reference_loss_and_grad_norm(hf_dirs[family], x, y, num_microbatches=8)
    first = read_metrics(runs(family))[0]
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert first["grad_norm"] > 0.5, "clipping must be active for the parity tests to mean anything"


# GPT-2's tied matrix spans the first and last pipeline ranks in dp2 x pp2 as in pp4 interleaved:
# one row of it suffices (its resume and export tests below reuse that run).
@pytest.mark.parametrize(
    "family,layout",
    [
        ("llama", "dp2-pp2-1f1b-balance-time"),
        ("llama", "dp1-pp4-interleaved"),
        ("llama", "cp2"),
        ("gpt2", "dp2-pp2-1f1b"),
    ],
)
def test_layout_matches_one_process(family: str, layout: str, runs, weights) -> None:
    run, reference = runs(family, layout), runs(family)
    assert max_weight_diff(weights(family, layout), weights(family)) < 1e-5
    norms = [[row["grad_norm"] for row in read_metrics(r) if "grad_norm" in row] for r in (run, reference)]
    assert len(norms[0]) == 10 and norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5)


def test_tied_matrix_is_saved_once(weights) -> None:
    """Both stages hold a copy (checked bit-identical before every save); the checkpoint holds one tensor."""
    saved = weights("gpt2", "dp2-pp2-1f1b")
    assert "embed.wte.weight" in saved and not any(k.startswith("head.") for k in saved)


def interrupted(run: Path, dest: Path, *, at_step: int) -> Path:
    """The run as a kill after `at_step` leaves it: later checkpoints gone, no summary."""
    shutil.copytree(run, dest)
    for folder in (dest / "checkpoints").glob("step-*"):
        if int(folder.name.split("-")[1]) > at_step:
            shutil.rmtree(folder)
    (dest / "checkpoints" / "latest").write_text(f"step-{at_step:08d}\n")
    (dest / "summary.json").unlink()
    return dest


@pytest.mark.parametrize("dp,pp", [(2, 2), (1, 1)])
def test_tied_resume_and_resharded_resume(
    dp: int, pp: int, runs, weights, hf_dirs, data_dir: Path, tmp_path: Path
) -> None:
    """Fine-tuned GPT-2 written as dp2 x pp2 at step 5: the same layout resumes bit-identically,
    one process resumes to the same weights (1e-5)."""
    full = runs("gpt2", "dp2-pp2-1f1b")
    run = interrupted(full, tmp_path / "run", at_step=5)
    result = hf_train(
        data_dir, run, hf_dirs["gpt2"], **{**LAYOUTS["dp2-pp2-1f1b"], "parallel.dp": dp, "parallel.pp": pp}
    )
    assert "resumed from" in result.stderr
    resumed, reference = final_weights(run), weights("gpt2", "dp2-pp2-1f1b")
    if (dp, pp) == (2, 2):
        assert all(torch.equal(resumed[k], reference[k]) for k in reference)
        assert losses(run) == losses(full)
    else:
        assert max_weight_diff(resumed, reference) < 1e-5


def test_cp2_checkpoint_resumes_at_cp1(runs, weights, hf_dirs, data_dir: Path, tmp_path: Path) -> None:
    """Llama written as cp2 at step 5, resumed by one process: the weights of the uninterrupted cp2
    run (1e-5). cp ranks hold whole replicas, so the checkpoint is the same at any cp."""
    run = interrupted(runs("llama", "cp2"), tmp_path / "run", at_step=5)
    assert "resumed from" in hf_train(data_dir, run, hf_dirs["llama"]).stderr
    assert max_weight_diff(final_weights(run), weights("llama", "cp2")) < 1e-5


# the dp2 x pp2 run each family already trains for test_layout_matches_one_process (Llama's on the
# measured split), not one more launch
EXPORTED = {"llama": "dp2-pp2-1f1b-balance-time", "gpt2": "dp2-pp2-1f1b"}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers(family: str, runs, tmp_path: Path) -> None:
    """A checkpoint written as dp2 x pp2, exported with --hf: from_pretrained gives meshrun's logits."""
    from meshrun.cli.use_checkpoint import load_full_model

    run, out = runs(family, EXPORTED[family]), tmp_path / "exported"
    meshrun_in_process(["export", run, "--hf", out], tmp_path=tmp_path)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    ours = load_full_model(run)[0]
    theirs = load_reference(out).eval()
    tokens = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(input_ids=tokens).logits - ours(tokens)).abs().max().item() < 1e-5
    again = meshrun_in_process(["export", run, "--hf", out], tmp_path=tmp_path, check=False)
    assert again.returncode == 2 and "already exists" in again.stderr
    text = meshrun_in_process(["sample", run, "--prompt", "ab", "--tokens", "5"], tmp_path=tmp_path).stdout
    assert text.startswith("ab")
