"""The training loop: one optimizer step = all microbatches, unscale, clip, step, log."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from meshrun.checkpoint import dcp as checkpoint
from meshrun.checkpoint import resume
from meshrun.checkpoint.background import BackgroundSaves
from meshrun.checkpoint.paths import resume_candidates
from meshrun.config.schema import Config
from meshrun.data.dataset import MixtureDataset, TokenDataset, open_dataset
from meshrun.data.locations import training_data_dir
from meshrun.data.pairs import PairsDataset
from meshrun.files.console import say
from meshrun.hardware.precision import autocast, make_scaler
from meshrun.launcher import progress
from meshrun.launcher.outcome import Outcome
from meshrun.metrics import time_split
from meshrun.metrics.meters import device_utilisation, mfu_note, peak_memory_gb, peak_tflops, throughput
from meshrun.metrics.profiler import StepProfiler
from meshrun.metrics.report import RunReport, run_facts
from meshrun.metrics.run_dir import start_run_record
from meshrun.models.encdec import source_len
from meshrun.models.families import build_model, flops_at
from meshrun.parallel import timeline
from meshrun.parallel.compile import is_compiled
from meshrun.parallel.fsdp import measured_state_bytes
from meshrun.parallel.mesh import Mesh
from meshrun.parallel.parallelize import parallelize
from meshrun.training.loss import MicrobatchLoss
from meshrun.training.nonfinite import NonFiniteSteps
from meshrun.training.optim import Optimizers, clip_global_norm, schedule_change_note
from meshrun.training.preemption import Requests
from meshrun.training.step_records import AcrossRanks, StepResult, Window

T = TypeVar("T")


class Trainer:
    def __init__(self, cfg: Config, mesh: Mesh, data_dir: Path) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, mesh.device
        # Dropout streams (weights and data have their own seeds): one per tp group (Layout.seed_offset).
        torch.manual_seed(cfg.train.seed + mesh.seed_offset)
        # Steps and evaluations pass their own loss (batch_loss); this one only sets the microbatch count.
        self.model = parallelize(
            cfg, mesh, loss=MicrobatchLoss(cfg.accumulation_steps), amp=partial(autocast, cfg, mesh.device)
        )
        self.params = [p for part in self.model.parts for p in part.parameters()]
        self.compiles = any(is_compiled(part.blocks) for part in self.model.parts)
        self.norm_params = self.model.tied.counted_once(self.params)  # a tied matrix's two copies count once
        self.optimizers = Optimizers(self.model.parts, cfg.train)
        # fsdp/hsdp: each rank checks only its gradient shards, so every rank must agree on found_inf
        # (and tp: each rank checks its shards)
        sharded = mesh.data_mesh is not None or mesh.size("tp") > 1
        self.scaler = make_scaler(cfg, self.device, dist.group.WORLD if sharded else mesh.group("pp"))
        seq_len, seed = cfg.model.seq_len, cfg.train.seed
        # how pairs data (if any) is batched: the encoder's share, the samples sharing a length bucket
        pairs_layout = {"source_len": source_len(cfg.model), "global_batch": cfg.train.global_batch}
        self.train_data = open_dataset(cfg.data, data_dir, "train", seq_len=seq_len, seed=seed, **pairs_layout)
        self.val_data = open_dataset(cfg.data, data_dir, "val", seq_len=seq_len, seed=seed, **pairs_layout)
        trained_on = training_data_dir(cfg)  # its tokenizer decodes
        self.data_card = tuple(p for p in (trained_on / "meta.json", trained_on / "tokenizer.json") if p.is_file())
        self.flops_model = build_model(cfg.model)  # on meta: prices a step's tokens at its length
        self.flops_by_length: dict[int, float] = {}
        self.peak = peak_tflops(self.device, cfg.metrics.peak_tflops, cfg.precision)
        self.run_dir = Path(cfg.run_dir)
        self.skipped_steps = 0  # fp16 steps the scaler skipped, over the whole run (checkpointed)
        self.state_bytes = 0  # params + grads + optimizer state on this rank, measured at the first step
        self.nonfinite = NonFiniteSteps(self.device)
        self.samples_seen = 0  # data position in global samples: survives a change of dp
        self.newer_checkpoints: tuple[Path, ...] = ()  # than the one resumed from: never deleted
        self.start_step = self.resume()
        # Rank 0 records the run; a complete one's record stays as it is (no tracker: nothing written).
        records = mesh.rank == 0 and self.start_step < cfg.train.steps
        self.report = RunReport(
            self.run_dir,
            steps=cfg.train.steps,
            tracker=start_run_record(cfg, start_step=self.start_step) if records else None,
            timeline_title=f"{cfg.layout.text()}, {cfg.accumulation_steps} microbatches:",
            start_step=self.start_step,
            plots=cfg.metrics.plots,
        )
        self.requests = Requests(self.run_dir, is_rank0=mesh.rank == 0)
        self.background = BackgroundSaves() if cfg.checkpoint.async_ else None  # checkpoint.async
        self.profiler = StepProfiler(cfg.profile, run_dir=self.run_dir, rank=mesh.rank, device=self.device)
        self.stragglers = time_split.Stragglers(
            ratio=cfg.metrics.straggler_ratio, windows=cfg.metrics.straggler_windows
        )
        time_split.start(self.device, at=time.perf_counter())  # train() starts it again with its first window

    def resume(self) -> int:
        """Load the newest loadable checkpoint (falling back past ones that fail); returns its step.

        Checkpoints exist but none loads: stop before anything in the run directory changes.
        """
        candidates = resume_candidates(self.run_dir, self.cfg.train.resume)
        failures: list[tuple[Path, checkpoint.CheckpointError]] = []
        for path in candidates:
            try:
                same_layout = resume.saved_degrees(path) == self.mesh.layout.mesh_degrees
                progress.mark_init("loading checkpoint", f" {path}")
                state = checkpoint.load(self.state_dict(0, rng=same_layout), path)
            except checkpoint.CheckpointError as exc:
                if self.cfg.train.resume != "auto" and path == candidates[-1]:
                    raise  # the checkpoint named by train.resume
                if self.mesh.rank == 0:
                    say(f"warning: {exc}; trying an older checkpoint")
                failures.append((path, exc))
                continue
            step = int(state["progress.step"])
            self.newer_checkpoints = resume.newer_than(self.run_dir, step)
            self.load_state_dict(state)
            if self.mesh.rank == 0:
                lineage = self.cfg.train.resume != "auto" and path != candidates[-1]
                since = f" (saved by this run since it started from {self.cfg.train.resume})" if lineage else ""
                say(f"resumed from {path} at step {step}{since}")
                if note := schedule_change_note(resume.saved_train_steps(path), self.cfg.train, step):
                    say(note)
            return step
        if failures:
            raise resume.no_checkpoint_loads(self.run_dir, failures)
        return 0

    def local_batch(
        self, data: TokenDataset | MixtureDataset | PairsDataset, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's share of the global batch starting at global sample `position`."""
        shard = self.mesh.data_shard(self.cfg.train.global_batch)
        x, y = data.batch(position + shard.start, len(shard))
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def batch_loss(
        self, data: TokenDataset | MixtureDataset | PairsDataset, position: int, *, scaler: GradScaler | None
    ) -> MicrobatchLoss:
        """The loss of the global batch at `position`: divided by that whole batch's non-pad target
        tokens (read from the data, no collective) and, fp16, multiplied by the scaler's current scale."""
        return MicrobatchLoss.for_batch(
            self.cfg.accumulation_steps,
            target_tokens=data.target_tokens(position, self.cfg.train.global_batch),
            dp=self.mesh.size("dp"),
            grad_scale=None if scaler is None else scaler.scale(torch.ones((), device=self.device)),
        )

    def train(self) -> Outcome:
        """Run to train.steps (COMPLETED), or until a stop request (STOPPED, a checkpoint written)."""
        cfg = self.cfg.train
        window, row = Window(start=self.clock()), {}
        time_split.start(self.device, at=window.start)
        if self.start_step >= cfg.steps:  # no tracker was opened (the record stays as it is): say it here
            if self.mesh.rank == 0:
                say(f"run already complete at step {self.start_step}; nothing to do")
            return Outcome.COMPLETED
        if note := mfu_note(self.device, self.peak):
            self.report.note(note)
        for step in range(self.start_step, cfg.steps):
            done = step + 1
            log_due = done % cfg.log_interval == 0 or done == cfg.steps
            # the timeline of a logged step
            with self.profiler.step(done, measure=self.mesh.size("pp") > 1 and log_due):
                result = self.train_step(step)
            if step == self.start_step and self.compiles:  # the first step compiled the blocks
                self.report.note(f"step {done} compiled and ran in {time.perf_counter() - window.start:.1f} s")
            window.add(result, flops_per_token=self.flops_per_token(result.tokens // cfg.global_batch))
            self.skipped_steps += result.skipped
            if result.state_bytes is not None:
                self.state_bytes = result.state_bytes
            self.report.tick(done)
            requested, stop = self.requests.poll()  # asked for before this step: every rank acts now
            if self.background is not None and (written := self.background.poll()):  # a failed write raises
                self.report.note(f"saved checkpoint {written} (written in the background)")
            eval_due = cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.steps)
            save_due = requested or self._checkpoint_due(done)
            if log_due or eval_due or save_due:
                self.nonfinite.raise_if_any()  # before anything reads or saves these weights
            if log_due:
                progress.mark("log")
                end = self.clock()  # the next window starts where this one ends: no time is lost
                split = time_split.close(at=end)
                row = self._log_window(window, result, done, train_s=end - window.start - window.paused, split=split)
                window = Window(start=end)
            pauses: dict[str, float] = {}  # validation and checkpoint: timed apart, their own row at this step
            if eval_due:
                progress.mark("eval")
                time_split.phase("eval")
                pauses["val_loss"], pauses["eval_s"] = self.timed(self.evaluate)
                row["val_loss"] = pauses["val_loss"]
            if save_due:  # preemption and the end of the run save synchronously
                progress.mark("checkpoint")
                time_split.phase("checkpoint")
                background = self.background is not None and not stop and done < cfg.steps
                path, pauses["checkpoint_s"] = self.timed(partial(self.save, done, background=background))
                blocked = f"in {pauses['checkpoint_s']:.2f} s"
                self.report.note(
                    f"staged checkpoint {path.name} {blocked}; writing it in the background"
                    if background
                    else f"saved checkpoint {path} {blocked}"
                )
            if pauses:
                window.paused += pauses.get("eval_s", 0.0) + pauses.get("checkpoint_s", 0.0)
                self.report.log(done, pauses)
            if stop and done < cfg.steps:
                progress.mark("finishing")
                self.report.note(f"stop requested: checkpoint at step {done} written; rerun the same command to resume")
                return Outcome.STOPPED
        progress.mark("checkpoint")
        self.finish_background()  # checkpoint.at_end false: the last interval save
        progress.mark("finishing")  # the summary and pictures: no longer watched
        self._summary(row)
        return Outcome.COMPLETED

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

    def state_dict(self, step: int, *, rng: bool = True) -> dict[str, torch.Tensor]:
        """Everything needed to continue exactly, as named tensors (see checkpoint.py).

        RNG states (dropout) are per rank: they are restored only into the same dp, tp and pp.
        """
        state = {
            **checkpoint.model_state(self.model.parts),
            **checkpoint.optimizer_state(self.model.parts, self.optimizers.optimizers),
            "progress.step": torch.tensor(step),
            "progress.samples_seen": torch.tensor(self.samples_seen),
            "progress.skipped_steps": torch.tensor(self.skipped_steps),
        }
        if self.scaler is not None:
            state["scaler.scale"] = torch.tensor(self.scaler.get_scale(), dtype=torch.float64)
            state["scaler.growth_tracker"] = torch.tensor(self.scaler.state_dict()["_growth_tracker"])
        if rng:
            state[f"rng.{self.mesh.rank}.cpu"] = torch.get_rng_state()
            if self.device.type == "cuda":
                state[f"rng.{self.mesh.rank}.cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        checkpoint.load_model_state(self.model.parts, state)
        checkpoint.load_optimizer_state(self.model.parts, self.optimizers.optimizers, state)
        self.samples_seen = int(state["progress.samples_seen"])
        self.skipped_steps = int(state["progress.skipped_steps"])
        if f"rng.{self.mesh.rank}.cpu" in state:
            torch.set_rng_state(state[f"rng.{self.mesh.rank}.cpu"])
        if f"rng.{self.mesh.rank}.cuda" in state:
            torch.cuda.set_rng_state(state[f"rng.{self.mesh.rank}.cuda"], self.device)
        if self.scaler is not None:
            self.scaler.load_state_dict(
                {
                    **self.scaler.state_dict(),
                    "scale": float(state["scaler.scale"]),
                    "_growth_tracker": int(state["scaler.growth_tracker"]),
                }
            )

    def save(self, step: int, *, background: bool = False) -> Path:
        """A checkpoint of `step`. `background` (checkpoint.async): returns once the state is
        staged; the folder appears when its write is done (see BackgroundSaves)."""
        self.model.tied.check_identical()  # the checkpoint keeps one of the two copies
        publishing = {
            "keep": self.cfg.checkpoint.keep,
            "config": self.cfg.model_dump(mode="json"),
            "protected": self.newer_checkpoints,
            "data_card": self.data_card,
        }
        if background and self.background is not None:
            return self.background.start(self.state_dict(step), self.run_dir, step, **publishing)
        self.finish_background()
        return checkpoint.save(self.state_dict(step), self.run_dir, step, **publishing)

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
        x, y = self.local_batch(self.train_data, self.samples_seen)
        loss_fn = self.batch_loss(self.train_data, self.samples_seen, scaler=self.scaler)
        tokens = self.cfg.train.global_batch * x.shape[-1]  # a length bucket may be shorter
        self.samples_seen += self.cfg.train.global_batch
        lr = self.optimizers.set_lr(step)
        # Forward and backward over every microbatch; DDP all-reduces only on the last one.
        self.model.train()
        time_split.phase("forward_backward")
        loss = self.model.forward_backward(x, y, loss=loss_fn)
        self.model.tied.sync_gradients()  # both copies of a tied embedding get the summed gradient
        progress.mark("optimizer", "gradient norm over the stages, then the optimizer step")
        time_split.phase("optimizer")
        # fp16: back to real units; found_inf is all-reduced over the pipeline stages.
        if self.scaler is not None:
            self.optimizers.unscale_(self.scaler)
        grad_norm = self.clip_gradients()  # the global norm, over every stage
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
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, tokens=tokens, skipped=skipped, state_bytes=held)

    def clip_gradients(self) -> torch.Tensor:
        """The global norm over all stages, the gradients clipped to it (optim.clip_global_norm)."""
        pp_group = self.mesh.group("pp") if self.mesh.size("pp") > 1 else None
        return clip_global_norm(self.params, self.norm_params, max_norm=self.cfg.train.grad_clip, pp_group=pp_group)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over `eval_batches` validation batches: each batch's token mean weighted
        by its target tokens (padded batches of pairs hold different numbers)."""
        self.model.train(False)
        total, tokens = torch.zeros((), device=self.device), 0
        for batch in range(self.cfg.train.eval_batches):
            position = batch * self.cfg.train.global_batch
            loss_fn = self.batch_loss(self.val_data, position, scaler=None)
            weight = self.val_data.target_tokens(position, self.cfg.train.global_batch)
            total += weight * self.model.evaluate(*self.local_batch(self.val_data, position), loss=loss_fn)
            tokens += weight
        return self._across_ranks(total / tokens).loss

    def _across_ranks(self, loss: torch.Tensor, extra: tuple[float, ...] = ()) -> AcrossRanks:
        """`loss` averaged over the ranks that hold it (Layout.loss_ranks: the last stage's), with every
        rank's peak memory, training-state bytes and `extra`."""
        own = [peak_memory_gb(self.device), self.state_bytes, *extra]
        mine = torch.cat([loss.double().reshape(1), torch.tensor(own, dtype=torch.float64, device=self.device)])
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        with time_split.section("wait"):  # at a log step (inside an evaluation: its time)
            dist.all_gather(gathered, mine)
        counted = self.mesh.layout.loss_ranks()
        return AcrossRanks(
            loss=sum(gathered[r][0].item() for r in counted) / len(counted),
            memory_gb=[g[1].item() for g in gathered],
            state_bytes=int(max(g[2].item() for g in gathered)),
            extra=[g[3:].tolist() for g in gathered],
        )

    def flops_per_token(self, length: int) -> float:
        """Training FLOPs per token of `length`-token samples (a length bucket is shorter), per length."""
        if length not in self.flops_by_length:
            self.flops_by_length[length] = flops_at(self.flops_model, length)
        return self.flops_by_length[length]

    def _log_window(
        self, window: Window, last: StepResult, done: int, *, train_s: float, split: dict[str, float]
    ) -> dict:
        """The row of a window ending with step `last`: `train_s` are its steps' seconds, validation
        and checkpoints left out; `split`: this rank's seconds per part of the whole window."""
        utilisation = device_utilisation(self.device)
        figures = (*split.values(), float("nan") if utilisation is None else utilisation)
        ranks = self._across_ranks(window.loss / window.steps, figures)
        memory = ranks.memory_gb
        row = {
            "loss": ranks.loss,
            "lr": last.lr,
            "grad_norm": last.grad_norm.item(),
            **throughput(
                tokens=window.tokens,
                seconds=train_s,
                flops=window.flops,
                world_size=self.cfg.world_size,
                peak=self.peak,
            ),
            "step_time_s": train_s / window.steps,
            "train_s": train_s,
            **{f"samples/{name}": n for name, n in self.train_data.source_counts(0, self.samples_seen).items()},
            "memory_gb": max(memory),
            "state_bytes": ranks.state_bytes,
            **{
                f"memory_gb/stage{s}": max(memory[r] for r in self.mesh.layout.ranks_of_pp_rank(s))
                for s in range(self.mesh.size("pp"))
            },
        }
        row.update(time_split.split_row(ranks.extra, wall_s=train_s + window.paused))
        straggler, warning = self.stragglers.row(ranks.extra, layout=self.mesh.layout)
        row.update(straggler)
        if warning:
            self.report.note(warning)
        if self.scaler is not None:
            row.update(loss_scale=self.scaler.get_scale(), skipped_steps=self.skipped_steps)
        if self.mesh.size("pp") > 1:
            row["bubble"] = self._gather_timeline(done)
        self.report.log(done, row)
        return row

    def _gather_timeline(self, done: int) -> float:
        """Every rank's measured step to rank 0 (kept for the timeline picture); mean bubble fraction."""
        bubble, by_stage = timeline.gather_timelines(self.mesh.layout)
        self.report.keep_timeline(done, by_stage, bubble=bubble)
        return bubble

    def _summary(self, row: dict) -> None:
        """summary.json: the last row's losses and layout, the whole run's throughput and time."""
        if not self.report.active:
            return  # only the logging rank holds the rows
        summary = {
            "steps": self.cfg.train.steps,
            "final_loss": row.get("loss"),
            "final_val_loss": row.get("val_loss"),
            **self.report.run_totals(),
            **run_facts(self.cfg, row),
            "run_dir": str(self.run_dir.resolve()),
        }
        if self.scaler is not None:
            summary["skipped_steps"] = self.skipped_steps
        self.report.finish(summary)

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
        self.requests.close()
        self.report.close()
