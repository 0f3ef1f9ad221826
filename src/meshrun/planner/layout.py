"""One layout (a validated Config) -> its stages' profiles and every pp rank's memory."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.config import Config
from meshrun.plan import stage_ids, stages_per_rank, static_split
from meshrun.planner.memory import RankMemory, rank_memory
from meshrun.planner.profile import StageProfile, profile_stages


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


def layout_memory(cfg: Config, precision: str) -> LayoutMemory:
    """Profiles every stage of this layout and the memory of every pp rank."""
    par = cfg.parallel
    split = layout_split(cfg)
    stages = profile_stages(cfg, split, cfg.train.micro_batch, precision)
    per_rank = stages_per_rank(par.schedule, par.virtual_stages) if par.pp > 1 else 1
    ranks = [
        rank_memory(
            stages,
            stage_ids(r, par.pp, per_rank, schedule=par.schedule),
            schedule=par.schedule,
            rank=r,
            pp=par.pp,
            dp=par.dp,
            m=cfg.accumulation_steps,
        )
        for r in range(par.pp)
    ]
    return LayoutMemory(stages=stages, ranks=ranks)
