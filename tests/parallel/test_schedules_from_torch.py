"""Schedules come from torch.distributed.pipelining (issue 15): names resolve through torch's
`get_schedule_class`, the torch-free microbatch check refuses exactly what torch's constructors
refuse, and the schedules added that way (looped BFS, ZBV), a count torch accepts that meshrun
used to refuse (interleaved 1F1B, 3 microbatches on pp 2), and the split-backward schedules under
DDP at dp 2 (once refused) equal one process."""

from __future__ import annotations

import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    final_weights,
    losses,
    max_weight_diff,
    read_metrics,
    tiny,
    train_job,
)
from plain_reference import assert_grad_norms_match
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from meshrun.config.schema import ParallelConfig
from meshrun.errors import ConfigError
from meshrun.parallel.layout import SINGLE_STAGE_SCHEDULES, Layout, stages_per_rank
from meshrun.parallel.pipeline import schedule_class
from meshrun.parallel.stages import TORCH_SCHEDULE_NAMES, check_microbatches

# 4 blocks = 4 stages at pp 2 x 2 per rank; lr / clip as in test_pipeline: clipping active every step.
BASE = {"model.num_layers": 4, "train.steps": 4, "train.lr": 3e-3, "train.grad_clip": 0.5, "train.global_batch": 8}


def test_every_schedule_name_is_a_torch_schedule() -> None:
    config_names = typing.get_args(ParallelConfig.model_fields["schedule"].annotation)
    assert set(config_names) == set(TORCH_SCHEDULE_NAMES)
    for name in config_names:
        single = issubclass(schedule_class(name), PipelineScheduleSingle)
        assert single == (name in SINGLE_STAGE_SCHEDULES), f"{name}: one stage per rank is torch's to say"


@pytest.mark.parametrize("name", list(TORCH_SCHEDULE_NAMES))
def test_every_stage_has_one_rank(name: str) -> None:
    """Layout.stages_of and pp_rank_of_stage agree (the tied-embedding group needs the last stage's rank)."""
    per_rank = stages_per_rank(name, None)
    for pp in (2, 3, 4):
        layout = Layout(pp=pp, schedule=name, per_rank=per_rank)
        held = {stage: rank for rank in range(pp) for stage in layout.stages_of(rank)}
        assert sorted(held) == list(range(pp * per_rank))
        assert all(layout.pp_rank_of_stage(stage) == rank for stage, rank in held.items())


def torch_refuses(name: str, pp: int, num_microbatches: int) -> bool:
    """Build torch's schedule for every pipeline rank over stand-in stages (the attributes its
    constructors read); True when a constructor refuses the count."""
    per_rank = stages_per_rank(name, None)
    for rank in range(pp):
        stages = [
            SimpleNamespace(
                group_size=pp,
                group_rank=rank,
                num_stages=pp * per_rank,
                stage_index=index,
                is_first=index == 0,
                is_last=index == pp * per_rank - 1,
                submod=torch.nn.Identity(),
            )
            for index in Layout(pp=pp, schedule=name, per_rank=per_rank).stages_of(rank)
        ]
        cls = schedule_class(name)
        try:
            cls(
                stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
                n_microbatches=num_microbatches,
                loss_fn=lambda out, target: out,
                scale_grads=False,
            )
        except ValueError:
            return True
    return False


def torch_free_refuses(name: str, pp: int, num_microbatches: int) -> bool:
    try:
        check_microbatches(name, num_microbatches, pp)
    except ConfigError:
        return True
    return False


@pytest.mark.parametrize("name", list(TORCH_SCHEDULE_NAMES))
def test_torch_free_check_refuses_exactly_what_torch_refuses(name: str) -> None:
    verdicts = {
        (pp, n): (torch_free_refuses(name, pp, n), torch_refuses(name, pp, n)) for pp in (2, 3, 4) for n in range(1, 13)
    }
    assert {key for key, (ours, theirs) in verdicts.items() if ours != theirs} == set()
    if name == "interleaved-1f1b":
        assert not verdicts[4, 6][1] and verdicts[2, 5][1]  # the grid holds both answers


@pytest.fixture(scope="module")
def references(data_dir: Path, tmp_path_factory: pytest.TempPathFactory, plain_reference):
    """`references(global_batch)`: one meshrun process (weights) and plain torch (grad norms)."""
    runs: dict[int, tuple[dict, list[float], list[float]]] = {}

    def get(global_batch: int) -> tuple[dict, list[float], list[float]]:
        if global_batch not in runs:
            settings = {**BASE, "train.global_batch": global_batch}
            run = tmp_path_factory.mktemp("ref") / "run"
            train_job(tiny(data_dir, run, **settings), tmp_path=run.parent)
            runs[global_batch] = final_weights(run), losses(run), plain_reference(**settings).grad_norms
        return runs[global_batch]

    return get


@pytest.mark.parametrize(
    "schedule,global_batch,dp",
    [("looped-bfs", 8, 1), ("zbv", 8, 1), ("interleaved-1f1b", 6, 1), ("zbv", 8, 2), ("zero-bubble", 8, 2)],
    ids=["looped-bfs", "zbv", "interleaved-3-microbatches-on-pp2", "zbv-ddp-dp2", "zero-bubble-ddp-dp2"],
)
def test_schedule_matches_one_process(
    schedule: str, global_batch: int, dp: int, references, data_dir: Path, tmp_path: Path
) -> None:
    """dp 2 under ddp: the split weight-gradient pass bypasses DDP's hooks; each stage averages its
    gradients over the dp ranks after its last backward (parallel/pipeline.py's MarkedStage)."""
    weights, reference_losses, plain_norms = references(global_batch)
    run = tmp_path / "run"
    settings = {**BASE, "train.global_batch": global_batch, "parallel.pp": 2, "parallel.schedule": schedule}
    settings |= {"parallel.dp": dp, "parallel.dp_mode": "ddp"}
    train_job(tiny(data_dir, run, **settings), tmp_path=tmp_path)
    norms = [row["grad_norm"] for row in read_metrics(run) if "grad_norm" in row]
    assert min(norms) > 0.5, "clipping must be active for the test to mean anything"
    assert_grad_norms_match(norms, plain_norms)
    assert max_weight_diff(final_weights(run), weights) < 1e-5
    assert losses(run) == pytest.approx(reference_losses, abs=1e-5)
