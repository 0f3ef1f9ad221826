"""Predicted step time of a layout: compute + pipeline bubble + dp / tp / pp communication + fixed costs.

Compute per microbatch and stage = its training FLOPs / achieved FLOP/s (recomputed FLOPs at their
own calibrated cost), but never less than its kernels' launch floor (`kernel_floor_s` per unit, a
GPU's: a tiny model is launch-bound), plus the fixed cost of a forward and a backward (kernel
launches, Python) in proportion to the stage's share of the model's modules (blocks; embedding and
head one each): a stage of half the blocks launches about half the kernels, however many FLOPs its
head has. The pipeline runs m microbatches through p stages; the slowest rank sets the pace and
the schedule adds its bubble: GPipe and 1F1B (p - 1) slots, interleaved (p - 1) / v, zero bubble a
third of that (the weight backwards fill most of it). When a run is given, its measured bubble
replaces the formula. Communication runs at the link's bandwidth, not overlapped (an upper
bound), and each message also costs the fixed `p2p_s` (the link's latency, the schedule's
handling): the dp gradient all-reduce (ring: 2 (dp - 1) / dp of the gradient bytes; FSDP: an
all-gather of the parameters per forward and per backward when it reshards after forward, else
once per step, and a reduce-scatter of the gradients, each (s - 1) / s of the bytes, then HSDP's
all-reduce over replicas of the shard); tp: two all-reduces of the hidden state per block
forward and backward (Megatron's split; a recomputed block's forward again; under sequence
parallel each a reduce-scatter plus an all-gather: the same bytes in twice the messages); pp: the activation
transfers. Where ranks share one machine's compute (a CPU's cores, calibrated as
`parallel_devices` full-speed ranks' worth; GPUs: None, a device per rank), compute, bubble and
per-step work take max(1, ranks / parallel_devices) times what they take one rank alone. An FSDP
collective costs its own fixed `shard_s` (calibrated apart: its hooks copy and bookkeep far more
than a send). A logged step adds the gather of every rank's figures (`log_s`) and, under pp, its
timeline measured and gathered from every rank (`timeline_share` of the step), shared over the steps of
`train.log_interval`. A job whose blocks run compiled (train.compile on for the planned device)
computes `compiled_compute` times as long as eager, where calibration measured it (its bubble
with it: the bubble is idle compute slots); the optimizer step stays eager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.hardware.peaks import KERNEL_LAUNCH_S, KERNELS_PER_UNIT, MESSAGE_FLOOR_S, RUNTIME_BYTES, STEP_FLOOR_S
from meshrun.planner.stage_profile import StageProfile


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float  # per device
    peak_flops: float | None  # dense peak per device at the planned precision; None = unknown (CPU)
    intra_gbs: float  # link bandwidth within a node, GB/s per direction
    inter_gbs: float  # between nodes
    gpus_per_node: int

    def link_gbs(self, span: int) -> float:
        """The bandwidth of a collective over `span` neighbouring ranks: the node's link when they fit
        in one node, else the link between nodes."""
        return self.intra_gbs if span <= self.gpus_per_node else self.inter_gbs


@dataclass(frozen=True)
class Efficiency:
    """Constants `meshrun plan --calibrate` fits on a machine (defaults: a GPU's, from the table's
    floors in hardware/peaks.py and typical large-model efficiency)."""

    flops_fraction: float = 0.45  # achieved / peak FLOP/s in the model's compute
    achieved_flops: float | None = None  # measured FLOP/s per device (wins over the fraction; CPUs have no peak)
    action_s: float = 0.0  # fixed seconds per forward or backward of one microbatch through the whole model
    recompute_cost: float = 1.0  # a recomputed FLOP's seconds / another's (checkpoints re-enter autograd)
    step_s: float = STEP_FLOOR_S  # fixed seconds per optimizer step (optimizer, clipping, bookkeeping)
    p2p_s: float = MESSAGE_FLOOR_S  # fixed seconds per message a rank handles (latency + bookkeeping)
    parallel_devices: float | None = (
        None  # full-speed ranks a machine's shared compute is worth; None: a device per rank
    )
    kernel_floor_s: float = KERNELS_PER_UNIT * KERNEL_LAUNCH_S  # per unit and microbatch (forward +
    # backward): the least a GPU's launches take however few FLOPs; 0 where calibrated (action_s measured it)
    runtime_bytes: int = RUNTIME_BYTES  # each rank's memory before the model (a CPU process's resident torch)
    shard_s: float = MESSAGE_FLOOR_S  # fixed seconds per FSDP/HSDP collective (its hooks' copies and bookkeeping)
    log_s: float = 0.0  # seconds a logged step adds: every rank's figures gathered and read on the host
    timeline_share: float = 0.0  # under pp, what a logged step adds as a share of the step: its timeline is
    # measured (a clock read per action) and gathered from every rank
    compiled_compute: float | None = None  # a compiled job's compute seconds / eager's (train.compile: its
    # blocks compiled, embedding and head eager, as the probe ran); None: not measured, planned as eager

    def compute_factor(self, compiled: bool) -> float:
        """A rank's compute seconds relative to eager: the measured factor when its blocks compile, else 1."""
        return self.compiled_compute if compiled and self.compiled_compute is not None else 1.0

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
    allreduce: float  # the dp collectives' bytes at the link's bandwidth
    p2p: float  # the pipeline transfers' bytes at the link's bandwidth
    fixed: float
    messages: int = 0  # pipeline messages and DDP's collectives the busiest rank handles per step
    latency: float = 0.0  # messages x p2p_s + shard_collectives x shard_s
    shard_collectives: int = 0  # FSDP/HSDP collectives per step (a block's gathers, reduce-scatters)
    logging: float = 0.0  # a logged step's extra, shared over the steps of a log interval
    experts: float = 0.0  # parallel.ep: the all-to-alls and the experts' gradient sum (planner/experts.py)
    context: float = 0.0  # of compute: cp's all-to-alls on the slowest rank (planner/long_context.py)
    host: float = 0.0  # of compute: offload's host copies the compute did not hide (planner/long_context.py)

    @property
    def total(self) -> float:
        parts = (self.compute, self.bubble, self.allreduce, self.p2p, self.fixed, self.latency, self.logging)
        return sum(parts) + self.experts

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


DDP_BUCKET_BYTES = 25 * 2**20  # torch's DistributedDataParallel bucket_cap_mb default


@dataclass(frozen=True)
class DataParallel:
    """How gradients and parameters cross the dp ranks: `shard` ranks hold a shard each (FSDP /
    HSDP; 1 = DDP), replicas of a shard all-reduce; `regather` = FSDP gathers the parameters for
    every forward and backward (reshard after forward) rather than once per step."""

    dp: int = 1
    shard: int = 1
    regather: bool = False


def ring_s(nbytes: float, ranks: int, gbs: float, factor: float) -> float:
    """Seconds of a ring collective moving factor x (ranks - 1) / ranks of `nbytes` per rank."""
    return factor * (ranks - 1) / ranks * nbytes / (gbs * 1e9) if ranks > 1 else 0.0


def data_parallel(
    grad_bytes: float, param_bytes: float, units: int, dp: DataParallel, *, m: int, gbs: float
) -> tuple[float, int]:
    """One step's dp communication on a rank (bytes: its stages', unsharded): (seconds at the
    link's bandwidth, collectives)."""
    if dp.dp == 1:
        return 0.0, 0
    if dp.shard == 1:  # DDP: one all-reduce of the gradients in 25 MiB buckets (its default)
        return ring_s(grad_bytes, dp.dp, gbs, 2.0), math.ceil(grad_bytes / DDP_BUCKET_BYTES)
    gathers = 2 * m if dp.regather else 1
    replicas = dp.dp // dp.shard
    seconds = gathers * ring_s(param_bytes, dp.shard, gbs, 1.0) + ring_s(grad_bytes, dp.shard, gbs, 1.0)
    seconds += ring_s(grad_bytes / dp.shard, replicas, gbs, 2.0)  # HSDP: the shard's all-reduce over replicas
    return seconds, (gathers + 1 + (replicas > 1)) * units  # a collective per block and the root


def tensor_parallel_s(
    held: list[StageProfile],
    tp: int,
    *,
    gbs: float,
    eff: Efficiency,
    sequence_parallel: bool = False,
    experts_over_tp: bool = False,
) -> float:
    """Seconds of one microbatch's tp all-reduces on a rank: two per block forward and two backward
    (a recomputed block's forward twice), each of the whole hidden state; under sequence parallel
    each is a reduce-scatter and an all-gather, each moving half an all-reduce's bytes. A MoE block's
    MLP is whole on every tp rank (parallel/tp_styles.py's moe_block): it runs none of the MLP's
    (under sequence parallel: one all-gather forward, one backward, half of them). Where parallel.ep
    spans tp (`experts_over_tp`) it runs on the rank's own positions: none under sequence parallel,
    else one all-gather forward (its output) and one backward (the input's gradient)."""
    if tp == 1:
        return 0.0
    messages = sum(4 * s.blocks + 2 * s.recomputed_blocks for s in held)
    saved = (2 if sequence_parallel else 1) if experts_over_tp else (1 if sequence_parallel else 2)
    messages -= saved * sum(s.moe_blocks + s.recomputed_moe_blocks / 2 for s in held)
    hidden = max(s.hidden_bytes for s in held)
    if sequence_parallel:
        return 2 * messages * (ring_s(hidden, tp, gbs, 1.0) + eff.p2p_s)
    return messages * (ring_s(hidden, tp, gbs, 2.0) + eff.p2p_s)


def rank_compute_s(
    held: list[StageProfile], total_units: int, tokens: int, flops_per_s: float, eff: Efficiency
) -> float:
    """One microbatch's forward and backward through the stages a rank holds: FLOPs at the achieved
    rate but not below the launch floor, plus the fixed cost of a whole-model forward and backward
    (launches, Python) shared by the stages' modules: a stage of half the blocks launches about
    half the kernels, whatever their FLOPs."""
    return sum(
        max(
            (s.model_flops_per_token + eff.recompute_cost * s.recompute_flops_per_token + s.replicated_flops_per_token)
            * tokens
            / flops_per_s,
            eff.kernel_floor_s * (s.units + s.recomputed_blocks / 3),  # recompute launches a forward again
        )
        + 2 * eff.action_s * s.units / total_units
        for s in held
    )


def step_time(
    stages: list[StageProfile],
    local: list[list[int]],
    *,
    schedule: str,
    dp: DataParallel,
    tp: int = 1,
    sequence_parallel: bool = False,
    experts_over_tp: bool = False,
    m: int,
    tokens_per_microbatch: int,
    hw: Hardware,
    eff: Efficiency,
    log_interval: int = 1,
    measured_bubble: float | None = None,
    compiled: bool = False,
    extra: list[float] | None = None,
) -> StepTime:
    """`local[r]`: the stage indices pp rank r holds (stage profiles are per tp rank); a step of
    `log_interval` is logged; `compiled`: the blocks run compiled (train.compile); `dp`: under
    parallel.cp the dp x cp ranks that reduce gradients together; `extra[r]`: seconds pp rank r adds
    to each microbatch beyond compute and tp (cp's all-to-alls, offload's exposed copies: long_context.py)."""
    pp, v = len(local), len(local[0])
    flops_per_s = eff.flops_per_s(hw)
    total_units = sum(s.units for s in stages)
    tp_gbs = hw.link_gbs(tp)
    factor = eff.compute_factor(compiled)
    per_rank = [
        factor * rank_compute_s([stages[i] for i in held], total_units, tokens_per_microbatch, flops_per_s, eff)
        + tensor_parallel_s(
            [stages[i] for i in held],
            tp,
            gbs=tp_gbs,
            eff=eff,
            sequence_parallel=sequence_parallel,
            experts_over_tp=experts_over_tp,
        )
        + (extra[r] if extra else 0.0)
        for r, held in enumerate(local)
    ]
    world = dp.dp * pp * tp
    slowdown = eff.slowdown(min(world, hw.gpus_per_node))
    slowest = max(per_rank) * slowdown
    compute = m * slowest
    if measured_bubble is not None and pp > 1:
        bubble = compute * measured_bubble / (1.0 - measured_bubble)
    else:
        bubble = bubble_slots(schedule, pp, v) * slowest
    dp_gbs, pp_gbs = hw.link_gbs(dp.dp * tp), hw.link_gbs(world)
    allreduce, dp_messages = max(
        data_parallel(
            sum(stages[i].grad_bytes for i in held),
            sum(stages[i].param_bytes for i in held),
            sum(stages[i].units for i in held),
            dp,
            m=m,
            gbs=dp_gbs,
        )
        for held in local
    )
    boundary = max(s.boundary_bytes for s in stages)
    shard_collectives = dp_messages if dp.shard > 1 else 0
    poll = 1 if world > 1 else 0  # the trainer's stop-request poll: an all-reduce of every rank's flags
    messages = pipeline_messages(len(stages), local, m) + dp_messages - shard_collectives + poll
    p2p = 2 * (m * v + pp - 1) * boundary / (pp_gbs * 1e9) if pp > 1 else 0.0
    fixed = eff.step_s * slowdown
    latency = messages * eff.p2p_s + shard_collectives * eff.shard_s
    step = compute + bubble + allreduce + p2p + fixed + latency
    return StepTime(
        compute=compute,
        bubble=bubble,
        allreduce=allreduce,
        p2p=p2p,
        fixed=fixed,
        messages=messages,
        latency=latency,
        shard_collectives=shard_collectives,
        logging=(eff.log_s + (eff.timeline_share * step if pp > 1 else 0.0)) / log_interval,
    )
