"""One layout (a validated Config) -> its stages' profiles and every pp rank's memory."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config.schema import Config
from meshrun.parallel.fsdp import reshard_after_forward
from meshrun.parallel.materialise import build_stage
from meshrun.parallel.stages import static_split
from meshrun.planner.experts import dense_stages, with_experts
from meshrun.planner.long_context import context_stages
from meshrun.planner.memory import RankMemory, rank_memory
from meshrun.planner.stage_cost import profile_stages, state_bytes
from meshrun.planner.stage_profile import StageProfile


@dataclass(frozen=True)
class LayoutMemory:
    stages: list[StageProfile]  # pipeline order (v x pp of them under interleaved schedules)
    ranks: list[RankMemory]  # one per pp rank (dp replicas of a stage hold the same)

    @property
    def peak(self) -> int:
        return max(rank.total for rank in self.ranks)


def layout_split(cfg: Config) -> list[list[int]]:
    """Blocks per stage; measured balances (time / size) are planned as the even split."""
    split = static_split(cfg)
    if split is None:
        split = static_split(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"balance": "even"})}))
    assert split is not None  # an even split is always static
    return split


def regathers(cfg: Config) -> bool:
    """FSDP gathers the parameters for every forward and backward (it reshards after forward)."""
    return cfg.layout.shard_degree > 1 and reshard_after_forward(cfg.parallel)


def layout_memory(cfg: Config, precision: str, *, baseline: int = 0) -> LayoutMemory:
    """Profiles every stage of this layout (one cp rank's, under parallel.cp) and the memory of every pp rank."""
    stages = profile_stages(cfg, layout_split(cfg), cfg.train.micro_batch, precision)
    stages = context_stages(
        cfg,
        stages,
        lambda short: profile_stages(short, layout_split(short), short.train.micro_batch, precision),
        precision,
    )
    return LayoutMemory(stages=stages, ranks=ranks_memory(cfg, stages, baseline=baseline))


def ranks_memory(cfg: Config, stages: list[StageProfile], *, baseline: int = 0) -> list[RankMemory]:
    """The memory of every pp rank of this layout, from its stages' profiles (dp and tp ranks of
    one pp rank hold alike; `baseline`: the runtime's own bytes, each rank's). Under parallel.ep the
    experts' state is apart from dp_mode's (planner/experts.py)."""
    layout, par = cfg.layout, cfg.parallel
    split = layout_split(cfg) if par.ep > 1 else []
    held = dense_stages(cfg, stages, split) if par.ep > 1 else stages
    ranks = [
        rank_memory(
            held,
            layout.stages_of(r),
            schedule=par.schedule,
            rank=r,
            pp=par.pp,
            dp=par.dp * par.cp,  # cp ranks reduce gradients with the dp ranks (DDP over dp x cp)
            shard=layout.shard_degree,
            m=cfg.accumulation_steps,
            regather=regathers(cfg),
            baseline=baseline,
        )
        for r in range(par.pp)
    ]
    if par.ep == 1:
        return ranks
    return [with_experts(cfg, mem, [(stages[s], split[s]) for s in layout.stages_of(r)]) for r, mem in enumerate(ranks)]


def rank_state_bytes(cfg: Config) -> list[RankMemory] | None:
    """Every pp rank's training state (parameters, gradients, optimizer; no activations), from the
    stages built on the meta device: what --dry-run prints, and the same numbers the planner's
    `layout_memory` adds activations to. None when the split is measured at start."""
    split = static_split(cfg) if cfg.parallel.pp > 1 else [None]
    if split is None:
        return None
    num_stages = len(split)
    parts = [build_stage(cfg, layers=layers, first=i == 0, last=i == num_stages - 1) for i, layers in enumerate(split)]
    return ranks_memory(
        cfg, [StageProfile(*state_bytes(part, cfg.train, cfg.parallel.tp), 0, 0.0, 0.0, 0) for part in parts]
    )
