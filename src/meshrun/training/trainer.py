"""The training loop: one optimizer step = all microbatches, unscale, clip, step, log."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol, TypeVar

import torch
from torch.amp import GradScaler

from meshrun.checkpoint import dcp as checkpoint
from meshrun.checkpoint.background import BackgroundSaves
from meshrun.config.schema import Config
from meshrun.files.console import say
from meshrun.launcher import progress
from meshrun.launcher.outcome import Outcome
from meshrun.metrics import time_split
from meshrun.metrics.meters import mfu_note, peak_tflops
from meshrun.metrics.profiler import StepProfiler
from meshrun.metrics.report import RunReport
from meshrun.models.families import flops_at
from meshrun.models.lora import parameter_counts
from meshrun.models.moe import moe_layers
from meshrun.models.moe_balance import aux_gradient
from meshrun.models.protocol import ProtocolModule
from meshrun.parallel.compile import is_compiled
from meshrun.parallel.context import shard_batch
from meshrun.parallel.fsdp import measured_state_bytes
from meshrun.parallel.mesh import Mesh
from meshrun.tasks import Batches, SummedLoss, Task, occupancy, positions_per_sample
from meshrun.training.log_row import across_ranks, log_row, write_summary
from meshrun.training.loss import MicrobatchLoss
from meshrun.training.nonfinite import NonFiniteSteps
from meshrun.training.optim import clip_global_norm
from meshrun.training.preemption import Requests
from meshrun.training.state import TrainState
from meshrun.training.step_records import AfterStep, Following, StepResult, Window

T = TypeVar("T")


class StepRecovery(Protocol):
    """launch.recovery peer's (training/recovery.py): `trainer.train_step(step)`, trained again after a lost peer is replaced."""

    def step(self, trainer: Trainer, step: int) -> StepResult: ...

    def commit(self, loss: torch.Tensor) -> torch.Tensor: ...

    def follow(self, trainer: Trainer, after: AfterStep) -> None: ...

    def pending(self, trainer: Trainer) -> AfterStep | None: ...


@dataclass(frozen=True)
class TrainingData:
    """The splits a run trains and validates on, the task that reads them (its loss and validation
    figures), and the files that say how they were tokenized (saved with each checkpoint)."""

    train: Batches
    val: Batches
    card: tuple[Path, ...]
    task: Task


class Trainer:
    """The loop over a run's steps, built from what the run (training/run.py) made and resumed:
    constructing it opens no file, creates no process group and installs no signal handler."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        state: TrainState,
        *,
        data: TrainingData,
        flops_model: ProtocolModule,
        start_step: int,
        newer_checkpoints: tuple[Path, ...],
        report: RunReport,
        requests: Requests,
        background: BackgroundSaves | None,
        profiler: StepProfiler,
    ) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, mesh.device
        self.hold(state)
        self.train_data, self.val_data, self.data_card, self.task = data.train, data.val, data.card, data.task
        self.flops_model = flops_model  # on meta: prices a step's tokens at its length
        self.moe_layers = moe_layers(flops_model.blocks)  # MoE layer -> experts, whole model (routing figures)
        self.flops_by_length: dict[int, float] = {}
        self.peak = peak_tflops(self.device, cfg.metrics.peak_tflops, cfg.precision)
        self.run_dir = Path(cfg.run_dir)
        self.state_bytes = (0, 0)  # params + grads + optimizer state on this rank (all, trainable), at the first step
        self.lora_params = parameter_counts(flops_model) if cfg.model.lora is not None else None
        self.nonfinite = NonFiniteSteps(self.device)
        self.start_step, self.newer_checkpoints = start_step, newer_checkpoints  # newer: never deleted
        self.report, self.requests, self.background, self.profiler = report, requests, background, profiler
        self.stragglers = time_split.Stragglers(
            ratio=cfg.metrics.straggler_ratio, windows=cfg.metrics.straggler_windows
        )
        self.recovery: StepRecovery | None = None  # launch.recovery peer: a step broken by a lost peer is trained again

    def hold(self, state: TrainState) -> None:
        """Train `state` from here: the run's, or the one peer recovery built again over new meshes
        (HSDP: training/sharded_recovery.py)."""
        self.state, self.model, self.optimizers, self.scaler = state, state.model, state.optimizers, state.scaler
        self.params = [p for part in self.model.parts for p in part.parameters()]
        self.compiles = any(is_compiled(part.blocks) for part in self.model.parts)
        self.norm_params = self.model.tied.counted_once(self.params)  # a tied matrix's two copies count once
        self.norm_params = self.model.experts.dense(self.norm_params)  # split experts: summed over ep apart

    def drop_state(self) -> None:
        """Forget what `hold` took (peer recovery under HSDP: its FSDP2 modules hold the broken
        process group's groups, whose connections close only once nothing holds them); `hold` again."""
        del self.state, self.model, self.optimizers, self.scaler, self.params, self.norm_params

    def local_batch(self, data: Batches, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's share of the global batch starting at global sample `position` (under cp,
        this cp rank's positions of it: parallel/context.py)."""
        shard = self.mesh.data_shard(self.cfg.train.global_batch)
        x, y = data.batch(position + shard.start, len(shard))
        return shard_batch(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), self.mesh)

    def batch_loss(
        self, divisor: float, *, scaler: GradScaler | None, summed: SummedLoss | None = None
    ) -> MicrobatchLoss:
        """The loss of a global batch whose targets count `divisor` (their number, or their summed
        weights; read from the data, no collective): the task's summed loss (or `summed`) divided by
        it and, fp16, multiplied by the scaler's current scale."""
        return MicrobatchLoss.for_batch(
            self.cfg.accumulation_steps,
            target_tokens=divisor,
            dp=self.mesh.size("dp_cp"),  # cp ranks sum parts of the same samples, as dp ranks do
            grad_scale=None if scaler is None else scaler.scale(torch.ones((), device=self.device)),
            summed=self.task.summed(self.cfg) if summed is None else summed,
        )

    def train(self) -> Outcome:
        """Run to train.steps (COMPLETED), or until a stop request (STOPPED, a checkpoint written)."""
        cfg = self.cfg.train
        window, row = Window(start=self.clock()), {}
        time_split.start(self.device, at=window.start)
        joined = None if self.recovery is None else self.recovery.pending(self)  # a replacement's, after a step
        if self.start_step >= cfg.steps and joined is None:  # no tracker was opened (the record stays): say it here
            if self.mesh.rank == 0:
                say(f"run already complete at step {self.start_step}; nothing to do")
            return Outcome.COMPLETED
        if note := mfu_note(self.device, self.peak):
            self.report.note(note)
        if joined is not None:  # it takes up what follows that step where the survivors left it
            row, window = self._follow(joined)
            if joined.stop and joined.done < cfg.steps:
                return self._stopped(joined.done)
        for step in range(self.start_step, cfg.steps):
            done = step + 1
            log_due = self.log_due(done)
            timeline = self.mesh.size("pp") > 1 and log_due  # the timeline of a logged step
            result = self._step(step, window, measure=timeline)
            after = AfterStep(done, result, window, row, log_due=log_due)
            row, window = self._follow(after)
            if after.stop and done < cfg.steps:
                return self._stopped(done)
        progress.mark("checkpoint")
        self.finish_background()  # checkpoint.at_end false: the last interval save
        progress.mark("finishing")  # the summary and pictures: no longer watched
        write_summary(self, row)
        return Outcome.COMPLETED

    def _follow(self, after: AfterStep) -> tuple[dict, Window]:
        """What follows a step (`follow`; launch.recovery peer: taken up again after a lost peer is
        replaced); the last log row and the window now open."""
        if self.recovery is None:
            self.follow(after)
        else:
            self.recovery.follow(self, after)
        return after.row, after.window

    def follow(self, after: AfterStep) -> None:
        """What follows step `after.done`, decided alike on every rank, from `after.part` on: the stop
        poll, the log row, an evaluation, a checkpoint (each part marked in `after` as it starts)."""
        cfg, done = self.cfg.train, after.done
        if after.part <= Following.POLL:
            after.requested, after.stop = self._poll()  # asked for before this step: every rank acts now
        log_due = after.log_due
        eval_due = cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.steps)
        save_due = after.requested or self._checkpoint_due(done)
        if (log_due or eval_due or save_due) and after.part <= Following.LOG:
            self.nonfinite.raise_if_any()  # before anything reads or saves these weights
        if log_due and after.part <= Following.LOG:
            after.part = Following.LOG
            after.row, after.window = self._log(after.window, after.last, done)
        if eval_due and after.part <= Following.EVAL:  # validation and checkpoint: timed apart, their own row
            after.part = Following.EVAL
            after.pauses |= self._evaluate_timed()
            after.row.update((key, value) for key, value in after.pauses.items() if key.startswith("val_"))
        if save_due and after.part <= Following.SAVE:  # preemption and the end of the run save synchronously
            after.part = Following.SAVE
            after.pauses |= self._checkpoint_timed(done, background=not after.stop and done < cfg.steps)
        after.part = Following.DONE
        if after.pauses:
            after.window.paused += after.pauses.get("eval_s", 0.0) + after.pauses.get("checkpoint_s", 0.0)
            self.report.log(done, after.pauses)

    def log_due(self, done: int) -> bool:
        return done % self.cfg.train.log_interval == 0 or done == self.cfg.train.steps

    def _stopped(self, done: int) -> Outcome:
        progress.mark("finishing")
        self.report.note(f"stop requested: checkpoint at step {done} written; rerun the same command to resume")
        return Outcome.STOPPED

    def _step(self, step: int, window: Window, *, measure: bool) -> StepResult:
        """`train_step` (profiled when profile.steps names it), counted into the log `window`."""
        done = step + 1
        with self.profiler.step(done, measure=measure):
            result = self.train_step(step) if self.recovery is None else self.recovery.step(self, step)
        if step == self.start_step and self.compiles:  # the first step compiled the blocks
            self.report.note(f"step {done} compiled and ran in {time.perf_counter() - window.start:.1f} s")
        length = result.attention_length or result.tokens // self.cfg.train.global_batch
        window.add(result, flops_per_token=self.flops_per_token(length))
        self.state.skipped_steps += result.skipped
        if result.state_bytes is not None:
            self.state_bytes = result.state_bytes
        self.report.tick(done)
        return result

    def _poll(self) -> tuple[bool, bool]:
        """(save now, stop after saving) as every rank agrees; a background save that has finished
        writing is published (a failed write raises)."""
        requested, stop = self.requests.poll()
        if self.background is not None and (written := self.background.poll()):
            self.report.note(f"saved checkpoint {written} (written in the background)")
        return requested, stop

    def _log(self, window: Window, last: StepResult, done: int) -> tuple[dict, Window]:
        """The row of the log `window` that ends with step `done`, and the next window, which
        starts where this one ends: no time is lost."""
        progress.mark("log")
        end = self.clock()
        split = time_split.close(at=end)
        row = log_row(self, window, last, done, train_s=end - window.start - window.paused, split=split)
        return row, Window(start=end)

    def _evaluate_timed(self) -> dict[str, float]:
        """The validation loss, the task's figures and the seconds they took (not counted as training time)."""
        progress.mark("eval")
        time_split.phase("eval")
        figures, seconds = self.timed(self.evaluate)
        return {**figures, "eval_s": seconds}

    def _checkpoint_timed(self, done: int, *, background: bool) -> dict[str, float]:
        """A checkpoint of step `done` (`background`: when checkpoint.async allows it) and the
        seconds training was blocked for it."""
        progress.mark("checkpoint")
        time_split.phase("checkpoint")
        background = background and self.background is not None
        path, seconds = self.timed(partial(self.save, done, background=background))
        self.report.note(
            f"staged checkpoint {path.name} in {seconds:.2f} s; writing it in the background"
            if background
            else f"saved checkpoint {path} in {seconds:.2f} s"
        )
        return {"checkpoint_s": seconds}

    def clock(self) -> float:
        """Now, once the device has finished the work queued so far (what a host timer must wait for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def timed(self, work: Callable[[], T]) -> tuple[T, float]:
        """`work()` and the seconds it took."""
        start = self.clock()
        result = work()
        return result, self.clock() - start

    def _checkpoint_due(self, done: int) -> bool:
        ckpt = self.cfg.checkpoint
        return (ckpt.interval > 0 and done % ckpt.interval == 0) or (ckpt.at_end and done == self.cfg.train.steps)

    def save(self, step: int, *, background: bool = False) -> Path:
        """A checkpoint of `step`. `background` (checkpoint.async): returns once the state is
        staged; the folder appears when its write is done (see BackgroundSaves)."""
        self.model.tied.check_identical()  # the checkpoint keeps one of the two copies
        publishing = {
            "keep": self.cfg.checkpoint.keep,
            "config": self.cfg.model_dump(mode="json"),
            "protected": self.newer_checkpoints,
            "data_card": self.data_card,
            "base": self.state.base,  # a LoRA run's frozen base (its checkpoints hold the adapters)
        }
        if background and self.background is not None:
            return self.background.start(self.state.state_dict(step), self.run_dir, step, **publishing)
        self.finish_background()
        return checkpoint.save(self.state.state_dict(step), self.run_dir, step, **publishing)

    def finish_background(self) -> None:
        """Collective: wait for the asynchronous save in flight, if any, and publish it."""
        if self.background is None or self.background.writing is None:
            return
        self.report.note(f"waiting for checkpoint {self.background.writing.name} to be written in the background")
        written = self.background.wait()
        self.report.note(f"saved checkpoint {written} (written in the background)")

    def train_step(self, step: int) -> StepResult:
        """One optimizer step, in order, and what it produced; it moves the data position on.

        Nothing here reads a tensor on the host (tests/training/test_host_sync.py), fp16's scaler aside.
        """
        # What the step needs, fixed before it runs: the batch, the learning rate, and the loss
        # (this global batch's token count; fp16: the scale every stage multiplies by).
        progress.mark("data", step=step + 1)
        time_split.phase("data")
        position, count = self.state.samples_seen, self.cfg.train.global_batch
        x, y = self.local_batch(self.train_data, position)
        trained = self.train_data.target_tokens(position, count)
        loss_fn = self.batch_loss(
            self.task.divisor(self.train_data, position, count, targets=trained), scaler=self.scaler
        )
        tokens = count * positions_per_sample(self.train_data, x) * self.mesh.size("cp")  # a cp rank's x: T / cp
        rows = occupancy(self.train_data, position, count)
        self.state.samples_seen += count
        lr = self.optimizers.set_lr(step)
        # Forward and backward over every microbatch; DDP all-reduces only on the last one.
        self.model.train()
        time_split.phase("forward_backward")
        sequences = count / self.mesh.size("dp")  # the MoE balance loss's divisor, as the loss's (moe_balance.py)
        with aux_gradient(
            sequences_per_rank=sequences, microbatches=self.cfg.accumulation_steps, grad_scale=loss_fn.grad_scale
        ):
            loss = self.model.forward_backward(x, y, loss=loss_fn)
        self.model.tied.sync_gradients()  # both copies of a tied embedding get the summed gradient
        self.model.experts.sync_gradients()  # split experts: averaged over the ranks holding the same ones
        progress.mark("optimizer", "gradient norm over the stages, then the optimizer step")
        time_split.phase("optimizer")
        # fp16: back to real units; found_inf is all-reduced over the pipeline stages.
        if self.scaler is not None:
            self.optimizers.unscale_(self.scaler)
        grad_norm = self.clip_gradients()  # the global norm, over every stage
        rank_losses = None  # launch.recovery peer: no rank steps before every rank's gradients are final
        if self.recovery is not None:
            rank_losses = self.recovery.commit(loss)
        # Apply the step unless it is non-finite, decided on the device.
        skipped = False
        if self.scaler is not None:
            # The norm spans every stage's unscaled gradients: non-finite exactly when the scaler's
            # found_inf (all-reduced over the stages by unscale_) is set; update() then backs off.
            scale = self.scaler.get_scale()
            self.optimizers.step_unless(torch.isfinite(grad_norm).logical_not().float())
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizers.step_unless(self.nonfinite.skip(grad_norm, step))
        # Measured once, while the gradients are still held.
        held = measured_state_bytes(self.params, self.optimizers.optimizers) if step == self.start_step else None
        self.optimizers.zero_grad()  # now, not at the next step: evaluation and checkpoints hold no gradients
        time_split.phase("other")
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=tokens,
            trained=trained,
            skipped=skipped,
            state_bytes=held,
            padding=None if rows is None else rows.padding,
            attention_length=None if rows is None else rows.attention_length,
            rank_losses=rank_losses,
        )

    def clip_gradients(self) -> torch.Tensor:
        """The global norm over all stages, the gradients clipped to it (optim.clip_global_norm)."""
        pp_group = self.mesh.group("pp") if self.mesh.size("pp") > 1 else None
        return clip_global_norm(
            self.params,
            self.norm_params,
            max_norm=self.cfg.train.grad_clip,
            pp_group=pp_group,
            split_squared=self.model.experts.squared_norm(),
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """`val_loss`, the mean loss over `eval_batches` validation batches (each batch's mean weighted
        by its divisor: padded batches of pairs hold different numbers of targets, class weights
        weigh them), and the task's figures
        (`val_` + name) from its meter's counts summed over the ranks that compute the loss."""
        self.model.train(False)
        meter = self.task.meter(self.cfg, self.device)
        total, tokens, count = torch.zeros((), device=self.device), 0.0, self.cfg.train.global_batch
        for batch in range(self.cfg.train.eval_batches):
            position = batch * count
            weight = self.task.divisor(
                self.val_data, position, count, targets=self.val_data.target_tokens(position, count)
            )
            loss_fn = self.batch_loss(weight, scaler=None, summed=meter.summed)
            total += weight * self.model.evaluate(*self.local_batch(self.val_data, position), loss=loss_fn)
            tokens += weight
        ranks = across_ranks(self, total / tokens, tuple(meter.counts()))
        layout = self.mesh.layout
        counted = [r for r in layout.loss_ranks() if layout.coordinates(r).tp == 0]  # tp ranks: copies
        counts = [sum(ranks.extra[r][k] for r in counted) for k in range(len(ranks.extra[0]))]
        return {"val_loss": ranks.loss, **{f"val_{name}": v for name, v in meter.figures(counts).items()}}

    def flops_per_token(self, length: int) -> float:
        """Training FLOPs per token of `length`-token samples (a length bucket is shorter), per length."""
        if length not in self.flops_by_length:
            self.flops_by_length[length] = flops_at(self.flops_model, length)
        return self.flops_by_length[length]
