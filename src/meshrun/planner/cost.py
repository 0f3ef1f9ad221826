"""Predicted step time of a layout: compute + pipeline bubble + dp all-reduce + pp transfers.

Compute per microbatch and stage = its training FLOPs / achieved FLOP/s (recomputed FLOPs at their
own calibrated cost), plus the fixed cost of a forward and a backward (kernel launches, Python) in
proportion to the stage's share of the model's modules (blocks; embedding and head one each): a
stage of half the blocks launches about half the kernels, however many FLOPs its head has. The
pipeline runs m microbatches through p stages; the slowest rank sets the pace and the schedule adds its
bubble: GPipe and 1F1B (p - 1) slots, interleaved (p - 1) / v, zero bubble a third of that
(the weight backwards fill most of it). When a run is given, its measured bubble replaces the
formula. The dp gradient all-reduce (ring: 2 (dp - 1) / dp of the gradient bytes) and the
pp activation transfers run at the link's bandwidth, not overlapped (an upper bound); each
pipeline message also costs a fixed `p2p_s` (the schedule's send/receive handling and the link's
latency). Where ranks share one machine's compute (a CPU's cores, calibrated as `parallel_devices`
full-speed ranks' worth; GPUs: None, a device per rank), compute, bubble and per-step work take
max(1, ranks / parallel_devices) times what they take one rank alone: ranks beyond the cores
are time-shared.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.planner.stage_cost import StageProfile


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
    recompute_cost: float = 1.0  # a recomputed FLOP's seconds / another's (checkpoints re-enter autograd)
    step_s: float = 0.0  # fixed seconds per optimizer step (optimizer, clipping, bookkeeping)
    p2p_s: float = 3e-5  # fixed seconds per pipeline message a rank handles (NCCL's latency + schedule bookkeeping)
    parallel_devices: float | None = (
        None  # full-speed ranks a machine's shared compute is worth; None: a device per rank
    )

    def slowdown(self, ranks_per_machine: int) -> float:
        """Each rank's compute time relative to one rank alone when this many share one machine
        (a CPU's cores: they share parallel_devices' worth of full-speed compute)."""
        if self.parallel_devices is None:
            return 1.0
        return max(1.0, ranks_per_machine / self.parallel_devices)

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
    messages: int = 0  # pipeline messages the busiest rank handles per step

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


def pipeline_messages(num_stages: int, local: list[list[int]], m: int) -> int:
    """Sends and receives of the busiest rank per step: per microbatch, a stage receives its input
    and sends its gradient back unless it is the first, and sends its output and receives that
    gradient unless it is the last."""
    if num_stages == 1:
        return 0
    per_microbatch = [sum(2 * (i > 0) + 2 * (i < num_stages - 1) for i in held) for held in local]
    return m * max(per_microbatch)


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
    total_units = sum(s.units for s in stages)
    # the fixed cost of a whole-model forward and backward (launches, Python), shared by the stages'
    # modules: a stage of half the blocks launches about half the kernels, whatever their FLOPs
    per_rank = [
        sum(
            (s.model_flops_per_token + eff.recompute_cost * s.recompute_flops_per_token)
            * tokens_per_microbatch
            / flops_per_s
            + 2 * eff.action_s * s.units / total_units
            for s in (stages[i] for i in held)
        )
        for held in local
    ]
    world = dp * pp
    slowdown = eff.slowdown(min(world, hw.gpus_per_node))
    slowest = max(per_rank) * slowdown
    compute = m * slowest
    if measured_bubble is not None and pp > 1:
        bubble = compute * measured_bubble / (1.0 - measured_bubble)
    else:
        bubble = bubble_slots(schedule, pp, v) * slowest
    dp_gbs = hw.intra_gbs if dp <= hw.gpus_per_node else hw.inter_gbs
    pp_gbs = hw.intra_gbs if world <= hw.gpus_per_node else hw.inter_gbs
    grad_bytes = max(sum(stages[i].grad_bytes for i in held) for held in local)
    allreduce = 2 * (dp - 1) / dp * grad_bytes / (dp_gbs * 1e9) if dp > 1 else 0.0
    boundary = max(s.boundary_bytes for s in stages)
    messages = pipeline_messages(len(stages), local, m)
    p2p = 2 * (m * v + pp - 1) * boundary / (pp_gbs * 1e9) + messages * eff.p2p_s if pp > 1 else 0.0
    return StepTime(
        compute=compute, bubble=bubble, allreduce=allreduce, p2p=p2p, fixed=eff.step_s * slowdown, messages=messages
    )
