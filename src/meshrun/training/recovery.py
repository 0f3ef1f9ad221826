"""Peer recovery in a training worker (launch.recovery peer, issue 46): a lost worker is replaced
(launch/keeper.py) while the others live on; they notice the loss as a broken collective, leave the
broken process group, join its next generation with the replacement (parallel/regroup.py), rebuild
the layout's meshes and DDP over it, and hand the replacement their state from memory: the model,
the optimizer, the data position and the counters. The step that was in flight is trained again
by every rank, so no step is lost and none is trained twice.

Built for DDP over dp ranks, with or without pipeline stages, and HSDP without them (tp, cp, ep 1),
on CPUs (gloo), one node or several; config/topology.py refuses the rest. Under pp the ranks of every stage
regroup and train the step again, and a replacement takes its stage's state from a dp replica of
that stage; under HSDP its shard from the other replica's rank at its shard index, and every
survivor builds its FSDP2 state again over the new meshes (training/sharded_recovery.py). The
replacement joins at a step's start: a loss noticed inside a step (a pipeline transfer, a gradient
all-reduce, the norm over the stages) is recovered there. No rank steps its optimizer before every
rank's gradients are final (`commit`, the step's last collective), so a step broken before it was
applied nowhere. Dropout draws from a stream seeded per step and rank, so the step trained again
draws the same masks. A loss noticed in what follows a step (the stop poll, the log row's gathers,
an evaluation, a checkpoint: Trainer.follow) is recovered there: every rank has applied the step
(each passed its commit), the replacement takes the state after it, and every rank takes up what
follows it again from the part that broke; the commit gathers every rank's loss, so that the log
row's loss counts the lost rank's (its replacement gets it with the window).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

from meshrun.config.schema import Config
from meshrun.errors import RunError
from meshrun.hardware.device import pick_device
from meshrun.hardware.precision import resolve_precision
from meshrun.launcher import progress
from meshrun.parallel import regroup
from meshrun.parallel.experts import ExpertGradients
from meshrun.parallel.fsdp import local
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import Mesh, join_store, mesh_on
from meshrun.parallel.parallelize import LocalModel, wrap_data_parallel
from meshrun.parallel.tied import TiedEmbeddings
from meshrun.training import sharded_recovery
from meshrun.training.state import TrainState
from meshrun.training.step_records import AfterStep, Following, StepResult, Window

if TYPE_CHECKING:
    from meshrun.metrics.report import RunReport
    from meshrun.parallel.pipeline import PipelineModel
    from meshrun.training.trainer import Trainer

# How long a hung peer's collective takes to fail (torch's default; a killed one fails at once).
COLLECTIVE_TIMEOUT: timedelta = default_pg_timeout


@dataclass
class PeerRecovery:
    """This worker's place in the job's recoverable process group: the job's store (torchrun's
    agent's, which outlives every worker), the group's generation, and whether this worker was
    started in a lost one's place (it takes its state from a replica before its first step)."""

    store: dist.Store
    number: int
    replacement: bool
    joined: float  # when (time.time()) this worker joined the group's current generation
    received: Copy | None = None  # a replacement's: the state it took

    def step(self, trainer: Trainer, step: int) -> StepResult:
        """`trainer.train_step(step)`, trained again after a lost peer is replaced (the data position
        and the gradients of the broken attempt undone; no rank stepped its optimizer: `commit`
        precedes it); any other error is raised as it is."""
        while True:
            position, lost = trainer.state.samples_seen, None
            seed_step(trainer.cfg, trainer.mesh, step)
            try:
                return trainer.train_step(step)
            except RuntimeError as broken:
                if not regroup.lost_peer(broken):
                    raise
                lost = said(broken)
            # out of the except block: its traceback holds the broken DDP's frames (freed before its group)
            trainer.state.samples_seen = position
            trainer.optimizers.zero_grad()
            self.rejoin(trainer, step, cause=lost)

    def follow(self, trainer: Trainer, after: AfterStep) -> None:
        """`trainer.follow(after)`, taken up again at the part a lost peer broke once it is replaced
        (every rank applied step `after.done`: each passed its commit); any other error is raised as it is."""
        while True:
            try:
                return trainer.follow(after)
            except RuntimeError as broken:
                if not regroup.lost_peer(broken):
                    raise
                lost = said(broken)
            self.rejoin(trainer, after.done, cause=lost, after=after)

    def pending(self, trainer: Trainer) -> AfterStep | None:
        """A replacement's: what follows the step it joined after, from the part the survivors take
        up again, with their log window (its own loss in it: the commits gathered it); None when
        it joined at a step's start."""
        if self.received is None or self.received.part == Following.DONE:
            return None
        copy, rank = self.received, dist.get_rank()
        assert copy.window is not None
        steps, tokens, trained, padding, flops, start, paused, lr, grad_norm = copy.window[:WINDOW_FIELDS].tolist()
        losses = copy.window[WINDOW_FIELDS:].float()  # float32 on every rank: exact through float64
        window = Window(int(steps), int(tokens), int(trained), None if padding < 0 else int(padding), flops)
        window.loss, window.start, window.paused = losses[rank].clone(), start, paused
        window.rank_losses = losses if steps else None
        last = StepResult(torch.zeros(()), torch.tensor(grad_norm, dtype=torch.float32), lr, 0, 0, False)
        done = trainer.start_step
        row, pauses = copy.figures.get("row", {}), copy.figures.get("pauses", {})
        return AfterStep(
            done, last, window, row, copy.part, copy.requested, copy.stop, pauses, log_due=trainer.log_due(done)
        )

    def commit(self, loss: torch.Tensor) -> torch.Tensor:
        """Collective over every rank, the step's last (its optimizer steps after it): once it
        returns on any rank, every rank's gradients are final. A peer lost before it fails it on
        every rank, and nobody has stepped; one lost inside it may have let some ranks step
        (`regroup.agreed_step` then stops the run in one line). Returns every rank's `loss` (by rank)."""
        progress.mark("optimizer", "every rank's gradients final before any optimizer steps (launch.recovery peer)")
        losses = [torch.zeros_like(loss) for _ in range(dist.get_world_size())]
        dist.all_gather(losses, loss.detach())
        return torch.stack(losses)

    def rejoin(self, trainer: Trainer, step: int, *, cause: str, after: AfterStep | None = None) -> None:
        """A survivor's recovery at `step` (`after`: in what follows it, whose part, stop flags and
        window the replacement gets too): the group rebuilt with the replacement, which gets its
        replica's state; the trainer continues on the new meshes. A rank lost meanwhile (the
        replacement as it takes its state) makes it start again with the next generation."""
        noticed, rank, kept = time.time(), trainer.mesh.rank, None
        where = lost_where(step, Following.DONE if after is None else after.part)
        while True:
            progress.mark("recovering", f"a peer was lost {where}: {cause}")
            try:
                kept = self.leave(trainer, step, kept)
                joined, copy = self.rebuild(trainer, step, rank, after, kept)
                break
            except RuntimeError as broken:
                if (gone := regroup.store_gone(broken)) is not None:
                    raise gone from None
                if not regroup.lost_peer(broken):
                    raise
                cause = "another rank lost while recovering: " + said(broken)
        if after is not None:
            after.part, after.requested, after.stop = copy.part, copy.requested, copy.stop
        regroup.recovered(self.store, self.number)
        announce(trainer.report, copy, noticed=noticed, joined=joined)
        trainer.stragglers.excuse()

    def leave(
        self, trainer: Trainer, step: int, kept: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor] | None:
        """A survivor's: out of the broken group, every group and wrapper cut from it dropped first.
        Returns HSDP's local shards (FSDP2's modules are bound to the old mesh: its state is built
        again over the new one, sharded_recovery.py), or those `kept` last time where the trainer
        holds no state since (a rank lost before it was built again); None: the model kept, unwrapped."""
        if not sharded_recovery.rebuilds(trainer.mesh):
            unwrap(trainer.state.model)
        elif hasattr(trainer, "state"):  # Trainer.drop_state deletes it
            kept = sharded_recovery.kept_shards(trainer, step)
        trainer.requests.leave()
        regroup.release([trainer.mesh.world, *trainer.mesh.views.values(), trainer.mesh.expert_grid])
        gc.collect()  # the broken DDP freed before its group is destroyed (freed after, it hung a process)
        self.number = regroup.next_generation(self.store, lost=self.number)
        regroup.tear_down()
        return kept

    def rebuild(
        self, trainer: Trainer, step: int, rank: int, after: AfterStep | None, kept: dict[str, torch.Tensor] | None
    ) -> tuple[float, Copy]:
        """A survivor's (`rank`): the next generation joined with the replacement, the model wrapped
        over its meshes (or, under HSDP, its state built again around the `kept` shards), the state
        shared; when the replacement joined and what it was sent."""
        world = trainer.cfg.world_size
        regroup.arrive(self.store, self.number, rank)
        with regroup.ended_by_sigterm():
            regroup.await_world(self.store, number=self.number, world=world, within=trainer.cfg.launch.rdzv_timeout)
            regroup.join(self.store, number=self.number, rank=rank, world=world, timeout=COLLECTIVE_TIMEOUT)
        joined = time.time()  # the replacement is there
        mesh = mesh_on(trainer.mesh.layout, trainer.device)
        if kept is None:
            rewrap(trainer.state.model, mesh, trainer.cfg)
        else:  # HSDP: FSDP2's modules are bound to the old mesh
            trainer.hold(sharded_recovery.rebuilt(trainer.cfg, mesh, kept))
        trainer.mesh = mesh
        copy = share_state(trainer.state, mesh, step, holds=True, after=after)
        trainer.requests.regroup()  # after the state, where the replacement makes its own (Run)
        return joined, copy

    def receive(self, state: TrainState, mesh: Mesh) -> int:
        """A replacement's: the state of a surviving replica, at the step that was in flight; returns it."""
        try:
            self.received = share_state(state, mesh, 0, holds=False)
        except RuntimeError as broken:
            if not regroup.lost_peer(broken):
                raise
            raise RunError(  # the replica sending it, or the replacement of a rank lost since, is gone
                f"rank {dist.get_rank()}'s state was not copied: a rank was lost while it was copied (the replica "
                "sending it, or another); rerun the same command to resume from the newest checkpoint (from the start "
                "if none)"
            ) from None
        return self.received.step

    @property
    def joined_after_step(self) -> bool:
        """A replacement's: it joined in what follows a step (it takes that up before the next step)."""
        return self.received is not None and self.received.part != Following.DONE

    def announce_received(self, report: RunReport) -> None:
        """The replacement on rank 0 records its own recovery (its run record opened after it)."""
        assert self.received is not None
        announce(report, self.received, noticed=self.received.lost_at, joined=self.joined)


def join(layout: Layout, *, join_timeout: int, replacement: bool) -> tuple[Mesh, PeerRecovery]:
    """init_mesh for a recoverable job: the first generation of the group, or, for a replacement,
    the one the survivors move to once they noticed the loss, over the agent's store."""
    device, _ = pick_device()
    if device.type != "cpu":
        raise RunError(
            f"launch.recovery peer runs on CPUs (gloo) so far, not on {device.type}; use launch.recovery checkpoint"
        )
    store, rank, world = join_store(join_timeout)
    timeout = timedelta(seconds=join_timeout)
    number = regroup.awaited_generation(store, timeout=timeout, rank=rank) if replacement else 0
    if replacement:
        regroup.arrive(store, number, rank)
    regroup.join(store, number=number, rank=rank, world=world, timeout=COLLECTIVE_TIMEOUT)
    if replacement:
        regroup.joined(store, number, rank)
    return mesh_on(layout, device), PeerRecovery(store, number, replacement, time.time())


def resolved_alone(cfg: Config, device: torch.device) -> Config:
    """A replacement's precision, resolved without asking the others (the survivors agreed on it at
    the start, on this same node)."""
    return cfg.model_copy(update={"precision": resolve_precision(cfg.precision, device).precision})


# What follows a step, as a recovery line says where a peer was lost in it.
FOLLOWING_WORDS = {
    Following.POLL: "the stop poll",
    Following.LOG: "the log row's gathers",
    Following.EVAL: "an evaluation",
    Following.SAVE: "a checkpoint save",
}


def said(broken: RuntimeError) -> str:
    """A broken collective's message on one line, cut to 200 characters (for the recovery's progress mark)."""
    return " ".join(str(broken).split())[:200]


def lost_where(step: int, part: Following) -> str:
    """Where a loss was noticed, in words: in the step after `step` steps, or in `part` of what follows it."""
    return f"at step {step + 1}" if part == Following.DONE else f"after step {step} (in {FOLLOWING_WORDS[part]})"


WINDOW_FIELDS = 9  # steps, tokens, trained, padding, flops, start, paused, lr, grad_norm; then each rank's loss


@dataclass(frozen=True)
class Copy:
    """A state copied from replicas: to each `fresh` rank from its source (`sources`, in that order),
    at `step`, for a rank lost at `lost_at` (time.time(), its keeper's; 0: not known); `part` of what
    follows the step every rank takes up again (DONE: none, the next step is trained), the stop
    poll's answer and the log window (`window_tensor`) with it."""

    sources: dict[int, int]
    step: int
    lost_at: float
    part: Following = Following.DONE
    requested: bool = False
    stop: bool = False
    window: torch.Tensor | None = None
    figures: dict[str, dict] = field(default_factory=dict)  # the source's last log row and evaluation (figures_of)
    done: float = field(default_factory=time.time)

    @property
    def fresh(self) -> list[int]:
        return list(self.sources)


def share_state(state: TrainState, mesh: Mesh, step: int, *, holds: bool, after: AfterStep | None = None) -> Copy:
    """Collective: every tensor of `state` at `step` (a checkpoint's, RNG left out: dropout is
    seeded per step) from the lowest rank of each group of replicas that `holds` it to the others:
    the `dp_replicate` group, the ranks that hold the same state (DDP's dp group; under HSDP the
    ranks at the same shard index; under pp, of the same stage), each sending its local shards;
    under a loss in what follows the step (`after`), its part and log window."""
    part = Following.DONE if after is None else after.part
    flags = (False, False) if after is None else (after.requested, after.stop)
    part, (requested, stop) = regroup.agreed_step(step, holds=holds, part=part, flags=flags)
    if after is not None and after.part < part:  # rank 0 finished what this rank had not
        after.catch_up(Following(part))
    named = state.state_dict(step, rng=False)
    layout = mesh.layout
    window = None if part == Following.DONE else window_tensor(after, mesh.layout.world_size)
    sources = regroup.copy_from_replica(
        [local(named[key]) for key in sorted(named)] + ([] if window is None else [window]),
        holds=holds,
        group=mesh.group("dp_replicate"),
        replicas=lambda rank: layout.group_ranks(rank, "dp_replicate"),
    )
    if lost := [rank for rank, source in sources.items() if source is None]:
        raise RunError(
            f"no surviving replica holds rank {lost[0]}'s state (each of its dp replicas was lost); "
            "rerun with launch.recovery checkpoint to resume from the newest checkpoint"
        )
    copied_step = int(named["progress.step"])
    if copied_step == 0:  # nobody has stepped, but torch's state-dict helper made AdamW's state by a step at lr 0
        unstep(named)
    if not holds or copied_step == 0:
        state.load_state_dict(named)
    copied = {rank: source for rank, source in sources.items() if source is not None}
    when = regroup.lost_at(holds=holds)
    kept = {} if part == Following.DONE else figures_of(after, copied.get(dist.get_rank()))
    return Copy(copied, copied_step, when, Following(part), requested, stop, window, kept)


def unstep(named: dict[str, torch.Tensor]) -> None:
    """Optimizer state made before the first step (`_init_optim_state` in torch.distributed.checkpoint's
    state_dict: a step with zero gradients at lr 0, whose moments stay 0 but whose count is 1) as a
    fresh optimizer's: every step count 0. Left at 1, the first step trained again would be AdamW's
    second (its bias correction), not an uninterrupted run's first."""
    for key, tensor in named.items():
        if key.startswith("state.") and key.endswith(".step"):
            local(tensor).zero_()


def figures_of(after: AfterStep | None, source: int | None) -> dict[str, dict]:
    """Collective: the last log row and the evaluation's figures (`AfterStep.row`, `.pauses`) of the
    rank a replacement's state came from (`source`; the others: {}), for its own record (rank 0's)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if after is None else {"row": after.row, "pauses": after.pauses})
    return gathered[source] if source is not None else {}


def window_tensor(after: AfterStep | None, world: int) -> torch.Tensor:
    """The log window and the step's lr and norm as one float64 tensor (a replacement's: zeros, the
    shape filled by its replica's copy): each rank's loss in it (float32, exact)."""
    window = torch.zeros(WINDOW_FIELDS + world, dtype=torch.float64)
    if after is not None:
        w, last = after.window, after.last
        padding = -1 if w.padding is None else w.padding
        head = [w.steps, w.tokens, w.trained, padding, w.flops, w.start, w.paused, last.lr, last.grad_norm.item()]
        window[:WINDOW_FIELDS] = torch.tensor(head, dtype=torch.float64)
        if w.rank_losses is not None:
            window[WINDOW_FIELDS:] = w.rank_losses.double()
    return window


def unwrap(model: LocalModel | PipelineModel) -> None:
    """The broken group's data-parallel wrappers, pipeline schedules (their stages hold its
    transfers) and the groups the model holds dropped, so that they are freed before the group is
    destroyed (regroup.release)."""
    model.tied.group = None
    if isinstance(model, LocalModel):
        model.wrapped = model.parts[0]
    else:
        model.wrapped, model.schedules = list[nn.Module](model.parts), {}
        if hasattr(model, "pp_group"):  # dropped already, where a rank was lost while recovering
            del model.pp_group


def rewrap(model: LocalModel | PipelineModel, mesh: Mesh, cfg: Config) -> None:
    """What `parallelize` makes over the process group once the parts are built, over `mesh`, in
    its order (a replacement's parallelize makes the same collectives): each part's data-parallel
    wrapper (no weights sent: they come from a replica), the pipeline's stage group (its schedules
    are made again at the next step) and the tied embedding's groups."""
    wrapped = [wrap_data_parallel(part, mesh, cfg, init_sync=False) for part in model.parts]
    if isinstance(model, LocalModel):
        model.wrapped = wrapped[0]
    else:
        model.wrapped, model.pp_group = wrapped, mesh.group("pp")
        model.tied = TiedEmbeddings(model.parts, model.plan.local_stages, num_stages=model.plan.num_stages, mesh=mesh)
    model.experts = ExpertGradients(model.parts, mesh)


def seed_step(cfg: Config, mesh: Mesh, step: int) -> None:
    """Dropout's stream at `step` on this rank: the same when the step is trained again."""
    torch.manual_seed(hash((cfg.train.seed, mesh.seed_offset, step)) % 2**63)


def announce(report: RunReport, copy: Copy, *, noticed: float, joined: float) -> None:
    """The recovery as one console line and a metrics.jsonl event (rank 0's record): from the loss
    (the earlier of its keeper's clock and when this rank noticed it) to the copy done, split at the
    replacement's joining the group (before: its start; after: its model built and the state copied)."""
    lost = ", ".join(map(str, copy.fresh))
    since = min(copy.lost_at, noticed) if copy.lost_at else noticed  # a rank lost while recovering: the first loss
    figures = {"recovery_s": copy.done - since, "rejoin_s": joined - since, "state_s": copy.done - joined}
    copied = ", ".join(
        f"rank {rank}'s state copied from rank {source}'s memory" for rank, source in copy.sources.items()
    )
    report.note(
        f"recovered {lost_where(copy.step, copy.part)} in {figures['recovery_s']:.1f} s ({figures['rejoin_s']:.1f} s until "
        f"the replacement joined, {figures['state_s']:.1f} s building its model and copying the state): "
        f"{copied}; no step lost"
    )
    sources = list(copy.sources.values())
    source = sources[0] if len(sources) == 1 else ", ".join(map(str, sources))  # as recovered_ranks: one per rank
    event = {"recovered_ranks": lost, "recovered_from": source, "lost_at": since, **figures, "steps_lost": 0}
    report.log(copy.step, event)  # lost_at: the loss's time.time(), its keeper's record's (launcher/failures.py)
