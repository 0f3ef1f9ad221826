"""Every layout of N devices for a config (global batch fixed), predicted and ranked."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshrun.config.schema import Config, validate
from meshrun.errors import ConfigError
from meshrun.parallel.stages import validate_layout
from meshrun.planner.cost import Efficiency, Hardware, StepTime, step_time
from meshrun.planner.layout_memory import layout_split, ranks_memory
from meshrun.planner.memory import RankMemory
from meshrun.planner.stage_cost import StageProfile, profile_stages

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "every:2", "full")


@dataclass(frozen=True)
class Prediction:
    cfg: Config
    memory: RankMemory  # the rank with the most memory
    time: StepTime
    tokens_per_s: float
    mfu: float | None
    fits: bool

    @property
    def label(self) -> dict[str, object]:
        par = self.cfg.parallel
        v = self.cfg.layout.per_rank
        return {
            "dp": par.dp,
            "pp": par.pp,
            "schedule": (par.schedule + (f"/v{v}" if v > 1 else "")) if par.pp > 1 else "-",
            "micro_batch": self.cfg.train.micro_batch,
            "microbatches": self.cfg.accumulation_steps,
            "recompute": self.cfg.recompute,
        }


def with_layout(
    cfg: Config, *, dp: int, pp: int, schedule: str, micro_batch: int, recompute: str, global_batch: int | None = None
) -> Config:
    """`cfg` with another layout (explicit stage_layers are dropped: they belong to one pp)."""
    data = cfg.model_dump(mode="json")
    data["parallel"].update(dp=dp, pp=pp, schedule=schedule, virtual_stages=None, stage_layers=None)
    data["train"]["micro_batch"] = micro_batch
    data["train"]["global_batch"] = global_batch or cfg.train.global_batch
    data["recompute"] = recompute
    data["launch"]["nproc_per_node"] = None
    return validate(data)


def candidates(cfg: Config, num_devices: int) -> list[Config]:
    """Layouts meshrun can run on `num_devices`: dp x pp = N, micro_batch dividing the batch."""
    found = []
    for dp in [d for d in range(1, num_devices + 1) if num_devices % d == 0]:
        pp = num_devices // dp
        if cfg.train.global_batch % dp:
            continue
        per_dp = cfg.train.global_batch // dp
        for schedule in SCHEDULES if pp > 1 else ("1f1b",):
            for micro_batch in [b for b in range(1, per_dp + 1) if per_dp % b == 0]:
                for recompute in RECOMPUTE:
                    try:
                        layout = with_layout(
                            cfg, dp=dp, pp=pp, schedule=schedule, micro_batch=micro_batch, recompute=recompute
                        )
                        validate_layout(layout)
                    except ConfigError:
                        continue
                    found.append(layout)
    return found


@functools.lru_cache(maxsize=256)
def _profiles(
    cfg_json: str, split: tuple[tuple[int, ...], ...], micro_batch: int, precision: str
) -> tuple[StageProfile, ...]:
    cfg = Config.model_validate_json(cfg_json)
    return tuple(profile_stages(cfg, [list(s) for s in split], micro_batch, precision))


def stage_profiles(cfg: Config, precision: str) -> list[StageProfile]:
    """Profiles depend on the model, split, micro_batch and recompute only: cached across layouts."""
    key = cfg.model_copy(update={"parallel": type(cfg.parallel)(), "train": type(cfg.train)()}).model_dump_json()
    split = tuple(tuple(s) for s in layout_split(cfg))
    return list(_profiles(key, split, cfg.train.micro_batch, precision))


def predict(
    cfg: Config, hw: Hardware, eff: Efficiency, *, precision: str, margin: float, measured_bubble: float | None = None
) -> Prediction:
    par = cfg.parallel
    stages = stage_profiles(cfg, precision)
    local = [cfg.layout.stages_of(r) for r in range(par.pp)]
    m = cfg.accumulation_steps
    worst = max(ranks_memory(cfg, stages), key=lambda rank: rank.total)
    time = step_time(
        stages,
        local,
        schedule=par.schedule,
        dp=par.dp,
        m=m,
        tokens_per_microbatch=cfg.train.micro_batch * cfg.model.seq_len,
        hw=hw,
        eff=eff,
        measured_bubble=measured_bubble,
    )
    tokens_per_s = cfg.tokens_per_step / time.total
    model_flops = sum(s.model_flops_per_token for s in stages)
    mfu = tokens_per_s * model_flops / (cfg.world_size * hw.peak_flops) if hw.peak_flops else None
    return Prediction(
        cfg=cfg,
        memory=worst,
        time=time,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        fits=worst.total <= hw.memory_bytes * (1.0 - margin),
    )


def rank_layouts(
    cfg: Config, num_devices: int, hw: Hardware, eff: Efficiency, *, precision: str, margin: float
) -> list[Prediction]:
    """Fitting layouts first, fastest first; then the ones that do not fit, smallest first."""
    predictions = [predict(c, hw, eff, precision=precision, margin=margin) for c in candidates(cfg, num_devices)]
    return sorted(predictions, key=lambda p: (not p.fits, p.time.total if p.fits else p.memory.total, p.memory.total))
