"""A log window's row and the run's summary: every rank's figures gathered, rank 0's record written
(training/trainer.py calls these at a log step, an evaluation and the end)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from meshrun.metrics import time_split
from meshrun.metrics.meters import device_utilisation, peak_memory_gb, throughput
from meshrun.metrics.report import run_facts
from meshrun.models.lora import lora_row
from meshrun.models.moe_balance import window_row
from meshrun.parallel import timeline
from meshrun.training.step_records import AcrossRanks, StepResult, Window

if TYPE_CHECKING:
    from meshrun.config.schema import Config
    from meshrun.metrics.report import RunReport
    from meshrun.metrics.time_split import Stragglers
    from meshrun.parallel.mesh import Mesh
    from meshrun.parallel.parallelize import LocalModel
    from meshrun.parallel.pipeline import PipelineModel
    from meshrun.tasks import Batches
    from meshrun.training.state import TrainState


class Trainer(Protocol):
    """What these read of training/trainer.py's Trainer (named here: it imports this module)."""

    cfg: Config
    mesh: Mesh
    device: torch.device
    state: TrainState
    model: LocalModel | PipelineModel
    scaler: GradScaler | None
    report: RunReport
    stragglers: Stragglers
    train_data: Batches
    run_dir: Path
    peak: float | None
    state_bytes: tuple[int, int]
    lora_params: tuple[int, int] | None
    moe_layers: dict[int, int]


def across_ranks(trainer: Trainer, loss: torch.Tensor, extra: tuple[float, ...] = ()) -> AcrossRanks:
    """`loss` averaged over the ranks that hold it (Layout.loss_ranks: the last stage's), with every
    rank's peak memory, training-state bytes and `extra`."""
    own = [peak_memory_gb(trainer.device), *trainer.state_bytes, *extra]
    mine = torch.cat([loss.double().reshape(1), torch.tensor(own, dtype=torch.float64, device=trainer.device)])
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    with time_split.section("wait"):  # at a log step (inside an evaluation: its time)
        dist.all_gather(gathered, mine)
    counted = trainer.mesh.layout.loss_ranks()
    return AcrossRanks(
        loss=sum(gathered[r][0].item() for r in counted) / len(counted),
        memory_gb=[g[1].item() for g in gathered],
        state_bytes=int(max(g[2].item() for g in gathered)),
        trainable_state_bytes=int(max(g[3].item() for g in gathered)),
        extra=[g[4:].tolist() for g in gathered],
    )


def log_row(
    trainer: Trainer, window: Window, last: StepResult, done: int, *, train_s: float, split: dict[str, float]
) -> dict:
    """The row of a window ending with step `last`: `train_s` are its steps' seconds, validation
    and checkpoints left out; `split`: this rank's seconds per part of the whole window."""
    utilisation = device_utilisation(trainer.device)
    figures = (*split.values(), float("nan") if utilisation is None else utilisation)
    ranks = across_ranks(trainer, window.loss / window.steps, figures)
    memory = ranks.memory_gb
    row = {
        "loss": ranks.loss,
        "lr": last.lr,
        "grad_norm": last.grad_norm.item(),
        **throughput(
            tokens=window.tokens,
            seconds=train_s,
            flops=window.flops,
            world_size=trainer.cfg.world_size,
            peak=trainer.peak,
        ),
        "trained_tokens_per_s": window.trained / train_s,
        **({} if window.padding is None else {"padding": window.padding / window.tokens}),
        "step_time_s": train_s / window.steps,
        "train_s": train_s,
        **{f"samples/{name}": n for name, n in trainer.train_data.source_counts(0, trainer.state.samples_seen).items()},
        "memory_gb": max(memory),
        "state_bytes": ranks.state_bytes,
        **({} if trainer.lora_params is None else lora_row(trainer.lora_params, ranks.trainable_state_bytes)),
        **{
            f"memory_gb/stage{s}": max(memory[r] for r in trainer.mesh.layout.ranks_of_pp_rank(s))
            for s in range(trainer.mesh.size("pp"))
        },
    }
    row.update(time_split.split_row(ranks.extra, wall_s=train_s + window.paused))
    # MoE: aux loss, tokens per expert (the ranks routing each token alike count once: Layout.routing_copies)
    row.update(
        window_row(trainer.model.parts, trainer.moe_layers, trainer.device, copies=trainer.mesh.layout.routing_copies)
    )
    straggler, warning = trainer.stragglers.row(ranks.extra, layout=trainer.mesh.layout)
    row.update(straggler)
    if warning:
        trainer.report.note(warning)
    if trainer.scaler is not None:
        row.update(loss_scale=trainer.scaler.get_scale(), skipped_steps=trainer.state.skipped_steps)
    if trainer.mesh.size("pp") > 1:
        row["bubble"] = gather_timeline(trainer, done)
    trainer.report.log(done, row)
    return row


def gather_timeline(trainer: Trainer, done: int) -> float:
    """Every rank's measured step to rank 0 (kept for the timeline picture); mean bubble fraction."""
    bubble, by_stage = timeline.gather_timelines(trainer.mesh.layout)
    trainer.report.keep_timeline(done, by_stage, bubble=bubble)
    return bubble


def write_summary(trainer: Trainer, row: dict) -> None:
    """summary.json: the last row's losses and layout, the whole run's throughput and time."""
    if not trainer.report.active:
        return  # only the logging rank holds the rows
    summary = {
        "steps": trainer.cfg.train.steps,
        "final_loss": row.get("loss"),
        "final_val_loss": row.get("val_loss"),
        **{f"final_{key}": value for key, value in row.items() if key.startswith("val_") and key != "val_loss"},
        **trainer.report.run_totals(),
        **run_facts(trainer.cfg, row),
        "run_dir": str(trainer.run_dir.resolve()),
    }
    if trainer.scaler is not None:
        summary["skipped_steps"] = trainer.state.skipped_steps
    trainer.report.finish(summary)
