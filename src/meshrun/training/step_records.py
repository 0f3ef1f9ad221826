"""What a training step and a log window hand on: kept on the device until a log step reads
them, so no step waits for the host."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import torch


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced. Its tensors stay on the device: the step never waits for
    the host; a log line reads them."""

    loss: torch.Tensor  # this rank's loss (0 off the last stage)
    grad_norm: torch.Tensor  # the global norm over every stage, before clipping
    lr: float
    tokens: int  # positions trained on: global batch x this batch's length (a length bucket is shorter)
    trained: int  # targets the loss counted (the global batch's non-IGNORE targets)
    skipped: bool  # fp16: the scaler found inf/NaN and backed off (fp32/bf16: see NonFiniteSteps)
    state_bytes: tuple[int, int] | None = None  # a segment's first step: params + grads + optimizer state on
    # this rank, all and the trainable parameters' only (fsdp.measured_state_bytes)
    padding: int | None = None  # packed documents: positions holding no document token (None: not known)
    attention_length: int | None = None  # packed documents: the length whose attention costs what theirs does
    rank_losses: torch.Tensor | None = None  # launch.recovery peer: every rank's loss (by rank), gathered by its commit


@dataclass
class Window:
    """Sums over the steps since the last log line (kept on device: no per-step sync)."""

    steps: int = 0
    tokens: int = 0  # positions trained on: global batch x its (bucket's) length, summed
    trained: int = 0  # targets the loss counted, summed
    padding: int | None = None  # packed documents' positions holding no document token, summed
    flops: float = 0.0  # those tokens x the FLOPs per token at their length
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    start: float = field(default_factory=time.perf_counter)
    paused: float = 0.0  # seconds of validation and checkpoints inside the window: not training time
    rank_losses: torch.Tensor | None = (
        None  # launch.recovery peer: every rank's `loss`, summed as each rank sums its own
    )

    def add(self, step: StepResult, *, flops_per_token: float) -> None:
        self.steps += 1
        self.tokens += step.tokens
        self.trained += step.trained
        if step.padding is not None:
            self.padding = (self.padding or 0) + step.padding
        self.flops += step.tokens * flops_per_token
        self.loss = self.loss + step.loss
        if step.rank_losses is not None:
            before = torch.zeros_like(step.rank_losses) if self.rank_losses is None else self.rank_losses
            self.rank_losses = before + step.rank_losses


class Following(IntEnum):
    """What follows a step, in this order, decided alike on every rank (Trainer.follow): the stop
    poll, the log window's row, an evaluation, a checkpoint; DONE: nothing left."""

    POLL = 0
    LOG = 1
    EVAL = 2
    SAVE = 3
    DONE = 4


@dataclass
class AfterStep:
    """What follows step `done`, as far as it got (`part`: the one under way; those before it are
    done on this rank): launch.recovery peer takes it up again at the part a lost peer broke."""

    done: int
    last: StepResult
    window: Window
    row: dict
    part: Following = Following.POLL
    requested: bool = False  # a checkpoint asked for (the stop poll's answer)
    stop: bool = False  # and a stop after it
    pauses: dict[str, float] = field(default_factory=dict)  # validation and checkpoint: their own row at `done`
    log_due: bool = True  # a log row is due at `done`

    def catch_up(self, part: Following) -> None:
        """Move on to `part`, the parts before it left to the ranks that finished them (rank 0 wrote their
        rows; launch.recovery peer): a log row not closed here starts this rank's next window anyway."""
        if self.part <= Following.LOG < part and self.log_due:
            self.window = Window(start=time.perf_counter())
        self.part = part


@dataclass(frozen=True)
class AcrossRanks:
    """A window's figures from every rank, in one all_gather."""

    loss: float  # averaged over dp (it lives on the last stage)
    memory_gb: list[float]  # each rank's peak, by rank
    state_bytes: int  # the largest rank's params + grads + optimizer state
    trainable_state_bytes: int  # the same, of the trainable parameters only (model.lora: the adapters)
    extra: list[list[float]]  # each rank's own further figures, by rank
