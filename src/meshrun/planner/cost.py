"""Predicted step time of a layout: compute + pipeline bubble + dp all-reduce + pp transfers.

Compute per microbatch and stage = its training FLOPs / achieved FLOP/s, plus the fixed cost of
a forward and a backward (kernel launches, Python) in proportion to the stage's share of the
model's FLOPs: a stage of half the blocks launches about half the kernels. The pipeline
runs m microbatches through p stages; the slowest rank sets the pace and the schedule adds its
bubble: GPipe and 1F1B (p - 1) slots, interleaved (p - 1) / v, zero bubble a third of that
(the weight backwards fill most of it). When a run is given, its measured bubble replaces the
formula. The dp gradient all-reduce (ring: 2 (dp - 1) / dp of the gradient bytes) and the
pp activation transfers run at the link's bandwidth, not overlapped (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.planner.profile import StageProfile


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float  # per device
    peak_flops: float | None  # dense peak per device at the planned precision; None = unknown (CPU)
    intra_gbs: float  # link bandwidth within a node, GB/s per direction
    inter_gbs: float  # between nodes
    gpus_per_node: int


@dataclass(frozen=True)
class Efficiency:
    """Constants `meshrun plan --calibrate` fits on a machine (defaults: typical large-model GPU runs)."""

    flops_fraction: float = 0.45  # achieved / peak FLOP/s in the model's compute
    achieved_flops: float | None = None  # measured FLOP/s per device (wins over the fraction; CPUs have no peak)
    action_s: float = 0.0  # fixed seconds per forward or backward of one microbatch through the whole model
    step_s: float = 0.0  # fixed seconds per optimizer step (optimizer, clipping, bookkeeping)

    def flops_per_s(self, hw: Hardware) -> float:
        if self.achieved_flops is not None:
            return self.achieved_flops
        if hw.peak_flops is None:
            raise ValueError(f"no peak FLOP/s known for {hw.name}: run `meshrun plan --calibrate` on it first")
        return hw.peak_flops * self.flops_fraction


@dataclass(frozen=True)
class StepTime:
    compute: float  # busy seconds of the slowest rank
    bubble: float  # idle seconds the schedule adds
    allreduce: float
    p2p: float
    fixed: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.allreduce + self.p2p + self.fixed

    @property
    def bubble_fraction(self) -> float:
        pipeline = self.compute + self.bubble
        return self.bubble / pipeline if pipeline else 0.0


def bubble_slots(schedule: str, pp: int, v: int) -> float:
    """Idle microbatch-slots the schedule adds on the slowest rank (its textbook formula)."""
    if pp == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return pp - 1.0
    if schedule == "interleaved-1f1b":
        return (pp - 1.0) / v
    return (pp - 1.0) / (3.0 * v)


def step_time(
    stages: list[StageProfile],
    local: list[list[int]],
    *,
    schedule: str,
    dp: int,
    m: int,
    tokens_per_microbatch: int,
    hw: Hardware,
    eff: Efficiency,
    measured_bubble: float | None = None,
) -> StepTime:
    """`local[r]`: the stage indices pp rank r holds."""
    pp, v = len(local), len(local[0])
    flops_per_s = eff.flops_per_s(hw)
    total_flops = sum(s.flops_per_token for s in stages)
    # the fixed cost of a whole-model forward and backward, shared by each stage's share of the work
    per_rank = [
        sum(
            stages[i].flops_per_token * (tokens_per_microbatch / flops_per_s + 2 * eff.action_s / total_flops)
            for i in held
        )
        for held in local
    ]
    slowest = max(per_rank)
    compute = m * slowest
    if measured_bubble is not None and pp > 1:
        bubble = compute * measured_bubble / (1.0 - measured_bubble)
    else:
        bubble = bubble_slots(schedule, pp, v) * slowest
    world = dp * pp
    dp_gbs = hw.intra_gbs if dp <= hw.gpus_per_node else hw.inter_gbs
    pp_gbs = hw.intra_gbs if world <= hw.gpus_per_node else hw.inter_gbs
    grad_bytes = max(sum(stages[i].grad_bytes for i in held) for held in local)
    allreduce = 2 * (dp - 1) / dp * grad_bytes / (dp_gbs * 1e9) if dp > 1 else 0.0
    boundary = max(s.boundary_bytes for s in stages)
    p2p = 2 * (m * v + pp - 1) * boundary / (pp_gbs * 1e9) if pp > 1 else 0.0
    return StepTime(compute=compute, bubble=bubble, allreduce=allreduce, p2p=p2p, fixed=eff.step_s)
