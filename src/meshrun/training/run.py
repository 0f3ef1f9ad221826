"""One training run in a worker: the state built and resumed from the newest loadable checkpoint,
the run record and its trackers opened, stop requests (signal handlers) and background saves set
up; then the `Trainer` is built from all of it, and `close` undoes it whatever happened."""

from __future__ import annotations

import time
from pathlib import Path

from meshrun.checkpoint import dcp as checkpoint
from meshrun.checkpoint import resume
from meshrun.checkpoint.background import BackgroundSaves
from meshrun.checkpoint.paths import resume_candidates
from meshrun.config.schema import Config
from meshrun.data.locations import training_data_dir
from meshrun.files.console import say
from meshrun.launcher import progress
from meshrun.metrics import time_split
from meshrun.metrics.profiler import StepProfiler
from meshrun.metrics.report import RunReport
from meshrun.metrics.run_dir import start_run_record
from meshrun.parallel.materialise import build_stage
from meshrun.parallel.mesh import Mesh
from meshrun.tasks import job_task
from meshrun.training.optim import schedule_change_note
from meshrun.training.preemption import Requests
from meshrun.training.recovery import PeerRecovery
from meshrun.training.state import TrainState, build_state
from meshrun.training.trainer import Trainer, TrainingData


class Run:
    """Owns what a run opens (collective: every rank constructs it at the same point); `trainer`
    trains it. A complete run (resumed at train.steps) opens no tracker: its record stays as it is."""

    def __init__(self, cfg: Config, mesh: Mesh, data_dir: Path, *, recovery: PeerRecovery | None = None) -> None:
        """`recovery`: launch.recovery peer's (a replacement takes its state from a replica, not a checkpoint)."""
        state = build_state(cfg, mesh)
        data = open_training_data(cfg, data_dir)
        flops_model = build_stage(cfg, layers=None, first=True, last=True)  # on meta, adapters too: prices a step
        run_dir = Path(cfg.run_dir)
        replacement = recovery if recovery is not None and recovery.replacement else None  # its state: a replica's
        start_step, newer_checkpoints = (
            (replacement.receive(state, mesh), ()) if replacement is not None else resume_state(cfg, mesh, state)
        )
        follows = replacement is not None and replacement.joined_after_step  # after the last step too
        records = mesh.rank == 0 and (start_step < cfg.train.steps or follows)  # rank 0 records the run
        self.report = RunReport(
            run_dir,
            steps=cfg.train.steps,
            tracker=start_run_record(cfg, start_step=start_step) if records else None,
            timeline_title=f"{cfg.layout.text()}, {cfg.accumulation_steps} microbatches:",
            start_step=start_step,
            plots=cfg.metrics.plots,
        )
        self.requests = Requests(run_dir, is_rank0=mesh.rank == 0)
        self.background = BackgroundSaves() if cfg.checkpoint.async_ else None  # checkpoint.async
        self.trainer = Trainer(
            cfg,
            mesh,
            state,
            data=data,
            flops_model=flops_model,
            start_step=start_step,
            newer_checkpoints=newer_checkpoints,
            report=self.report,
            requests=self.requests,
            background=self.background,
            profiler=StepProfiler(cfg.profile, run_dir=run_dir, rank=mesh.rank, device=mesh.device),
        )
        self.trainer.recovery = recovery
        if replacement is not None:
            replacement.announce_received(self.report)
            self.trainer.stragglers.excuse()
        time_split.start(mesh.device, at=time.perf_counter())  # train() starts it again with its first window

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
        self.requests.close()
        self.report.close()


CARD_FILES = ("meta.json", "tokenizer.json", "chat_template.jinja")  # how the data was tokenized (and rendered)


def open_training_data(cfg: Config, data_dir: Path) -> TrainingData:
    """The train and validation splits, batched as the job's task reads them, the task, and the
    files that say how they were tokenized (saved with each checkpoint)."""
    task = job_task(cfg, data_dir)
    trained_on = training_data_dir(cfg)  # its tokenizer decodes
    return TrainingData(
        train=task.open_split(cfg, data_dir, "train"),
        val=task.open_split(cfg, data_dir, "val"),
        card=tuple(p for p in (trained_on / name for name in CARD_FILES) if p.is_file()),
        task=task,
    )


def resume_state(cfg: Config, mesh: Mesh, state: TrainState) -> tuple[int, tuple[Path, ...]]:
    """Load the newest loadable checkpoint into `state` (falling back past ones that fail); returns
    its step and the checkpoints newer than it (never deleted).

    Checkpoints exist but none loads: stop before anything in the run directory changes.
    """
    run_dir = Path(cfg.run_dir)
    candidates = resume_candidates(run_dir, cfg.train.resume)
    failures: list[tuple[Path, checkpoint.CheckpointError]] = []
    for path in candidates:
        try:
            same_layout = resume.saved_degrees(path) == cfg.layout.mesh_degrees
            progress.mark_init("loading checkpoint", f" {path}")
            loaded = checkpoint.load(state.state_dict(0, rng=same_layout), path)
        except checkpoint.CheckpointError as exc:
            if cfg.train.resume != "auto" and path == candidates[-1]:
                raise  # the checkpoint named by train.resume
            if mesh.rank == 0:
                say(f"warning: {exc}; trying an older checkpoint")
            failures.append((path, exc))
            continue
        step = int(loaded["progress.step"])
        newer = resume.newer_than(run_dir, step)
        state.load_state_dict(loaded)
        if mesh.rank == 0:
            lineage = cfg.train.resume != "auto" and path != candidates[-1]
            since = f" (saved by this run since it started from {cfg.train.resume})" if lineage else ""
            say(f"resumed from {path} at step {step}{since}")
            if note := schedule_change_note(resume.saved_train_steps(path), cfg.train, step):
                say(note)
        return step, newer
    if failures:
        raise resume.no_checkpoint_loads(run_dir, failures)
    return 0, ()
