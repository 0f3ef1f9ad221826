"""Every layout of N devices for a config (global batch fixed), predicted and ranked."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshrun.config.schema import Config, validate
from meshrun.errors import ConfigError
from meshrun.models.hf_config import check_hf_context_split, check_hf_tensor_split
from meshrun.parallel.compile import compile_enabled
from meshrun.parallel.materialise import build_stage
from meshrun.parallel.stages import validate_layout
from meshrun.planner.cost import DataParallel, Efficiency, Hardware, StepTime, step_time
from meshrun.planner.experts import dense_stages, expert_degrees, expert_parallel_s
from meshrun.planner.layout_memory import layout_split, ranks_memory, regathers
from meshrun.planner.long_context import context_stages, long_context_s, offload_stages, with_host
from meshrun.planner.memory import RankMemory
from meshrun.planner.stage_cost import priced_at_length, profile_stages
from meshrun.planner.stage_profile import StageProfile

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "every:2", "full")
OFFLOADED = ("none", "every:2")  # recompute policies planned with offload too: its blocks are the rest


@dataclass(frozen=True)
class Prediction:
    cfg: Config
    memory: RankMemory  # the rank with the most memory
    ranks: list[RankMemory]  # every pp rank's (dp and tp ranks of one pp rank hold alike)
    time: StepTime
    tokens_per_s: float
    mfu: float | None
    fits: bool

    @property
    def label(self) -> dict[str, object]:
        par = self.cfg.parallel
        v = self.cfg.layout.per_rank
        return {
            "tp": par.tp,
            "dp": par.dp,
            "ep": par.ep,
            "dp_mode": (par.dp_mode if par.dp_mode != "hsdp" else f"hsdp/{self.cfg.layout.dp_shard}")
            + (f"+ep{par.ep}" if par.ep > 1 else ""),  # experts split over ep of the dp (and tp) ranks
            "pp": par.pp,
            "schedule": (par.schedule + (f"/v{v}" if v > 1 else "")) if par.pp > 1 else "-",
            "micro_batch": self.cfg.train.micro_batch,
            "microbatches": self.cfg.accumulation_steps,
            "recompute": self.cfg.recompute,
            "cp": par.cp,
            "offload": "-" if self.cfg.train.offload_activations is False else "on",
        }


def with_layout(
    cfg: Config,
    *,
    dp: int,
    pp: int,
    schedule: str,
    micro_batch: int,
    recompute: str,
    global_batch: int | None = None,
    tp: int = 1,
    cp: int = 1,
    dp_mode: str = "ddp",
    dp_shard: int | None = None,
    ep: int = 1,
    offload: bool = False,
) -> Config:
    """`cfg` with another layout (explicit stage_layers are dropped: they belong to one pp;
    sequence parallel, when the config asks for it, where tp > 1)."""
    data = cfg.model_dump(mode="json")
    data["parallel"].update(
        dp=dp,
        pp=pp,
        tp=tp,
        cp=cp,
        ep=ep,
        sequence_parallel=cfg.parallel.sequence_parallel and tp > 1,
        dp_mode=dp_mode,
        dp_shard=dp_shard,
        schedule=schedule,
        virtual_stages=None,
        stage_layers=None,
    )
    data["train"]["micro_batch"] = micro_batch
    data["train"]["global_batch"] = global_batch or cfg.train.global_batch
    data["recompute"] = recompute
    data["train"]["offload_activations"] = offload
    data["launch"]["nproc_per_node"] = None
    return validate(data)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def data_modes(dp: int) -> list[tuple[str, int | None]]:
    """(dp_mode, dp_shard) for dp ranks: DDP, FSDP over all, HSDP over each shard size between."""
    if dp == 1:
        return [("ddp", None)]
    hybrid: list[tuple[str, int | None]] = [("hsdp", s) for s in _divisors(dp)[1:-1]]
    return [("ddp", None), ("fsdp", None), *hybrid]


def meshes(cfg: Config, num_devices: int, per_node: int) -> list[Config]:
    """Every (tp, cp, dp, ep, dp_mode, pp, schedule) of `num_devices` that training would run, at
    micro_batch 1 and full recompute (its least memory): tp within a node, only where the model
    has a tp plan and its heads (kv heads, MLP width) divide by tp; cp where training would run it
    (config/context.py's checks: family, heads and seq_len divisible) and within a node beside tp
    (tp x cp <= per_node: the all-to-alls on every attention stay on the node's links); ep (a MoE model's) any divisor
    of dp, or tp times one (ep spanning tp), that divides its experts, within or across nodes (planner/experts.py)."""
    found = []
    tps = [t for t in _divisors(min(num_devices, per_node)) if num_devices % t == 0] if has_tp_plan(cfg) else [1]
    for tp, cp in ((t, c) for t in tps for c in _divisors(num_devices // t) if t * c <= per_node):
        for dp in _divisors(num_devices // tp // cp):
            pp = num_devices // tp // cp // dp
            if cfg.train.global_batch % dp:
                continue
            modes = itertools.product(data_modes(dp), SCHEDULES if pp > 1 else ("1f1b",), expert_degrees(cfg, dp, tp))
            for (dp_mode, shard), schedule, ep in modes:
                try:
                    layout = with_layout(
                        cfg,
                        dp=dp,
                        pp=pp,
                        tp=tp,
                        cp=cp,
                        dp_mode=dp_mode,
                        dp_shard=shard,
                        ep=ep,
                        schedule=schedule,
                        micro_batch=1,
                        recompute="full",
                    )
                    validate_layout(layout)
                    check_hf_tensor_split(layout)  # e.g. kv heads that tp does not divide
                    check_hf_context_split(layout)  # a decoder cp splits, heads that tp x cp divide
                except ConfigError:
                    continue
                found.append(layout)
    return found


def variants(mesh: Config, *, offload: bool = False) -> list[list[Config]]:
    """The micro_batch x recompute layouts of one mesh: one list per recompute policy (and, with
    `offload`, per policy of OFFLOADED with the blocks it does not recompute offloaded), smallest
    micro_batch first (activations grow with it: the first that does not fit ends the list)."""
    par = mesh.parallel
    per_dp = mesh.train.global_batch // par.dp
    out = []
    policies = [(r, False) for r in RECOMPUTE] + ([(r, True) for r in OFFLOADED] if offload else [])
    for recompute, offloaded in policies:
        row = []
        for micro_batch in _divisors(per_dp):
            try:
                layout = with_layout(
                    mesh,
                    dp=par.dp,
                    pp=par.pp,
                    tp=par.tp,
                    cp=par.cp,
                    dp_mode=par.dp_mode,
                    dp_shard=par.dp_shard,
                    ep=par.ep,
                    schedule=par.schedule,
                    micro_batch=micro_batch,
                    recompute=recompute,
                    offload=offloaded,
                )
                validate_layout(layout)
            except ConfigError:
                continue
            row.append(layout)
        out.append(row)
    return out


def candidates(cfg: Config, num_devices: int, per_node: int | None = None) -> list[Config]:
    """Layouts meshrun can run on `num_devices`: dp x pp x cp x tp = N, micro_batch dividing the batch."""
    return [c for mesh in meshes(cfg, num_devices, per_node or num_devices) for row in variants(mesh) for c in row]


@functools.lru_cache(maxsize=8)
def _has_tp_plan(model_json: str) -> bool:
    from meshrun.models.protocol import tp_plan

    cfg = Config.model_validate_json(model_json)
    return tp_plan(build_stage(cfg, layers=None, first=True, last=True)) is not None


def has_tp_plan(cfg: Config) -> bool:
    """The model can be split over tp ranks."""
    return _has_tp_plan(_model_key(cfg))


def _model_key(cfg: Config) -> str:
    """The config less its layout and training (what a stage's profile does not depend on)."""
    return cfg.model_copy(update={"parallel": type(cfg.parallel)(), "train": type(cfg.train)()}).model_dump_json()


@functools.lru_cache(maxsize=1024)
def _profiles(
    cfg_json: str, split: tuple[tuple[int, ...], ...], micro_batch: int, precision: str, tp: int, sp: bool
) -> tuple[StageProfile, ...]:
    cfg = Config.model_validate_json(cfg_json)
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"tp": tp, "sequence_parallel": sp})})
    return tuple(profile_stages(cfg, [list(s) for s in split], micro_batch, precision))


def rank_stages(cfg: Config, precision: str) -> list[StageProfile]:
    """`stage_profiles` of what one rank holds: under parallel.cp, one cp rank's positions."""
    return context_stages(
        cfg, stage_profiles(cfg, precision), lambda short: stage_profiles(short, precision), precision
    )


def stage_profiles(cfg: Config, precision: str) -> list[StageProfile]:
    """Profiles depend on the model, split, micro_batch, recompute, tp and sequence parallel only:
    cached across layouts."""
    split = tuple(tuple(s) for s in layout_split(cfg))
    par = cfg.parallel
    return list(_profiles(_model_key(cfg), split, cfg.train.micro_batch, precision, par.tp, par.sequence_parallel))


def compiles(cfg: Config, hw: Hardware) -> bool:
    """Whether `cfg`'s blocks run compiled on `hw` (train.compile resolved as training resolves it:
    auto is on for any GPU, off for a CPU)."""
    device = torch.device("cpu" if hw.name == "cpu" else "cuda")
    return compile_enabled(cfg.train.compile, device) and cfg.parallel.cp == 1  # cp's blocks run eager


def predict(
    cfg: Config,
    hw: Hardware,
    eff: Efficiency,
    *,
    precision: str,
    margin: float,
    measured_bubble: float | None = None,
    attention_length: int | None = None,
) -> Prediction:
    """`cfg`'s memory and step time on `hw`; `attention_length`: rows of packed documents whose
    attention costs that of this length (planner/documents.py), else full rows of model.seq_len.
    Under parallel.cp and train.offload_activations, as planner/long_context.py prices them."""
    par = cfg.parallel
    stages = rank_stages(cfg, precision)
    if attention_length is not None:
        stages = priced_at_length(cfg, stages, attention_length)
    split = layout_split(cfg)
    stages, host = offload_stages(cfg, stages, split, lambda c: rank_stages(c, precision))
    local = [cfg.layout.stages_of(r) for r in range(par.pp)]
    m = cfg.accumulation_steps
    ranks = with_host(cfg, ranks_memory(cfg, stages, baseline=eff.runtime_bytes), host)
    worst = max(ranks, key=lambda rank: rank.total)
    compiled = compiles(cfg, hw)
    factor = eff.compute_factor(compiled)
    context, copies = long_context_s(cfg, stages, host, precision, hw=hw, eff=eff, compute_factor=factor)
    shard = cfg.layout.shard_degree if par.cp > 1 else cfg.layout.dp_shard  # FSDP over dp_shard x cp
    time = step_time(
        dense_stages(cfg, stages, split) if par.ep > 1 else stages,  # the experts stay out of DDP / FSDP
        local,
        schedule=par.schedule,
        dp=DataParallel(dp=par.dp * par.cp, shard=shard, regather=regathers(cfg)),
        tp=par.tp,
        sequence_parallel=par.sequence_parallel,
        experts_over_tp=cfg.layout.experts_over_tp,
        m=m,
        tokens_per_microbatch=cfg.train.micro_batch * cfg.model.seq_len // par.cp,
        hw=hw,
        eff=eff,
        log_interval=cfg.train.log_interval,
        measured_bubble=measured_bubble,
        compiled=compiled,
        extra=[c + h for c, h in zip(context, copies)],
    )
    slowdown = eff.slowdown(min(cfg.world_size, hw.gpus_per_node))
    time = dataclasses.replace(
        time,
        experts=expert_parallel_s(cfg, stages, split, hw, eff),
        context=m * slowdown * max(context),
        host=m * slowdown * max(copies),
    )
    tokens_per_s = cfg.tokens_per_step / time.total
    model_flops = sum(s.model_flops_per_token for s in stages) * par.tp
    mfu = tokens_per_s * model_flops / (cfg.world_size * hw.peak_flops) if hw.peak_flops else None
    return Prediction(
        cfg=cfg,
        memory=worst,
        ranks=ranks,
        time=time,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        fits=worst.total <= hw.memory_bytes * (1.0 - margin),
    )


def rank_layouts(
    cfg: Config,
    num_devices: int,
    hw: Hardware,
    eff: Efficiency,
    *,
    precision: str,
    margin: float,
    progress: Callable[[str], None] | None = None,
    attention_length: int | None = None,
) -> list[Prediction]:
    """Fitting layouts first, fastest first; then the ones that do not fit, smallest first
    (`attention_length`: as predict's).

    Pruned before costing: a mesh whose least-memory layout (micro_batch 1, full recompute) does not
    fit is reported by that layout alone (on a GPU, its offloaded layouts are still tried: offload
    may hold less than full recompute), and per recompute policy the micro_batches beyond the
    first that does not fit are skipped (activations only grow with micro_batch). A CPU plan
    offers no offload: its host memory is its device's."""
    predictions = []
    all_meshes = meshes(cfg, num_devices, hw.gpus_per_node)
    for index, mesh in enumerate(all_meshes, 1):
        if progress is not None:
            progress(f"mesh {index}/{len(all_meshes)}: {mesh.layout.text()}")
        least = predict(mesh, hw, eff, precision=precision, margin=margin, attention_length=attention_length)
        rows = variants(mesh, offload=hw.name != "cpu")
        if not least.fits:
            predictions.append(least)
            rows = [row for row in rows if row and row[0].train.offload_activations is not False]
        for row in rows:
            for layout in row:
                if layout == mesh:
                    prediction = least
                else:
                    prediction = predict(
                        layout, hw, eff, precision=precision, margin=margin, attention_length=attention_length
                    )
                if prediction.fits or least.fits:
                    predictions.append(prediction)
                if not prediction.fits:
                    break
    return sorted(predictions, key=lambda p: (not p.fits, p.time.total if p.fits else p.memory.total, p.memory.total))
