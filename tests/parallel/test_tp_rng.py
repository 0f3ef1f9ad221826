"""Dropout under tensor parallelism (parallel/tp_rng.py), tp2 on gloo, real torchrun: masks equal
where the tp ranks hold the same activations and different where each holds its own part
(tp_masks_gpt.py checks them every step), recompute reruns the masks its first forward drew, and
a resumed run continues them."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import grad_norms, losses, meshrun_env, run_meshrun, tiny
from encdec_reference import train_encdec
from test_checkpoint import interrupted_copy
from test_encdec_parity import ENCDEC

from meshrun.config.model_sections import EncDecSection, GPTSection
from meshrun.models.encdec import EncDec
from meshrun.models.families import build_model
from meshrun.models.protocol import tp_plan
from meshrun.parallel.tp_rng import rank_stream_regions

DROPOUT = {"model.dropout": 0.1, "parallel.tp": 2, "train.steps": 2}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_masks_differ_where_tp_ranks_hold_different_activations(
    sequence_parallel: bool, data_dir: Path, tmp_path: Path
) -> None:
    """Attention's masks differ over the ranks' heads; the residual stream's are equal (replicated),
    and under sequence parallel differ (a rank's positions). A shared stream fails the first; a
    stream per rank everywhere fails the second (the hidden states drift apart)."""
    keys = {**DROPOUT, "model.factory": "tp_masks_gpt:build", "parallel.sequence_parallel": sequence_parallel}
    env = meshrun_env(tmp_path, PYTHONPATH=str(Path(__file__).parent))
    run_meshrun(["train", *tiny(data_dir, tmp_path / "run", **keys)], tmp_path=tmp_path, env=env, timeout=240)


def train(data_dir: Path, run: Path, **overrides: object) -> Path:
    """4 steps, a checkpoint every 2."""
    keys = {**DROPOUT, "train.steps": 4, "checkpoint.interval": 2, **overrides}
    run_meshrun(["train", *tiny(data_dir, run, **keys)], tmp_path=run.parent, timeout=240)
    return run


@pytest.fixture(scope="module")
def without_recompute(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """tp2 with dropout and no recompute, with and without sequence parallel."""
    tmp = tmp_path_factory.mktemp("no_recompute")
    return {sp: train(data_dir, tmp / f"sp{sp}", **{"parallel.sequence_parallel": sp}) for sp in (False, True)}


@pytest.mark.parametrize(
    "recompute,sequence_parallel", [("full", False), ("selective", False), ("full", True), ("selective", True)]
)
def test_recompute_reruns_the_same_masks(
    recompute: str, sequence_parallel: bool, without_recompute: dict[bool, Path], data_dir: Path, tmp_path: Path
) -> None:
    """Recompute's rerun draws the masks the first forward drew, in the shared and the rank streams:
    a different mask in the rerun gives the step's gradients of another forward (grad norm off)."""
    run = train(data_dir, tmp_path / "run", recompute=recompute, **{"parallel.sequence_parallel": sequence_parallel})
    reference = without_recompute[sequence_parallel]
    assert losses(run) == pytest.approx(losses(reference), rel=1e-6)
    assert grad_norms(run) == pytest.approx(grad_norms(reference), rel=1e-6)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_encdec_recompute_reruns_the_same_masks(sequence_parallel: bool, lopsided_dir: Path, tmp_path: Path) -> None:
    """The encoder-decoder's regions (self- and cross-attention, MLP; blocks taking the state tuple
    under sequence parallel): tp2 with dropout and full recompute logs what it logs without."""
    keys = {**DROPOUT, "parallel.sequence_parallel": sequence_parallel}
    runs = [train_encdec(lopsided_dir, tmp_path / r, ENCDEC, **keys, recompute=r) for r in ("none", "full")]
    assert losses(runs[1]) == pytest.approx(losses(runs[0]), rel=1e-6)
    assert grad_norms(runs[1]) == pytest.approx(grad_norms(runs[0]), rel=1e-6)


def test_a_resumed_run_continues_the_masks(without_recompute: dict[bool, Path], data_dir: Path, tmp_path: Path) -> None:
    """The rank streams are seeded from the shared one, whose state the checkpoint holds: resumed
    at step 2, tp2 with sequence parallel logs the uninterrupted run's losses and grad norms."""
    full = without_recompute[True]
    run = train(data_dir, interrupted_copy(full, tmp_path / "run", at_step=2), **{"parallel.sequence_parallel": True})
    assert losses(run) == losses(full) and grad_norms(run) == grad_norms(full)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_regions_are_attention_and_mlp_or_every_block_under_sequence_parallel(sequence_parallel: bool) -> None:
    """Without sequence parallel: each module holding a row-parallel Linear (self-attention,
    cross-attention, MLP), ending at that Linear; with it: every block, to its exit."""
    for model in (build_model(GPTSection(num_layers=2)), build_model(EncDecSection(num_layers=2))):
        plan = tp_plan(model)
        assert plan is not None
        names = {module: name for name, module in model.named_modules()}
        regions = rank_stream_regions(model, plan, sequence_parallel=sequence_parallel)
        got = {(names[module], names[end] if end is not None else None) for module, end in regions}
        if sequence_parallel:
            assert got == {(f"blocks.{i}", None) for i in range(2)}
        else:
            parts = ["attn", "mlp"] + (["cross"] if isinstance(model, EncDec) else [])
            assert got == {
                (f"blocks.{i}.{p}", f"blocks.{i}.{p}.proj") for i in range(2) for p in parts if (p, i) != ("cross", 0)
            }
