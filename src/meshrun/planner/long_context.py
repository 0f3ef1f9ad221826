"""What context parallel (`parallel.cp`) and activation offload (`train.offload_activations`)
change in a layout's plan: its stages' activations, its host memory and its step time.

Context parallel (parallel/context.py): a rank holds T / cp positions of every sample outside
attention and all T positions of heads / cp of the heads inside it, so every tensor a block saves
holds 1/cp of the whole's elements (q, k, v and attention's output: T x H / cp = T / cp x H). A
stage's activations are therefore traced at model.seq_len / cp (`context_stages`), with its
parameters, FLOPs per token and tp sizes those of the whole sequence (per-token attention FLOPs
are the whole row's: a rank attends T positions for 1/cp of the heads). Its cost is the
all-to-alls (`context_s`): in each attention's forward one each for q, k and v (T / cp positions
of every head in, T positions of H / cp heads out) and one returning the output, the same four on
the gradients in backward, a recomputed block's forward again, plus the gather of the rows'
positions per forward; each moves (cp - 1) / cp of what a rank holds at the link's bandwidth and
costs the calibrated per-message `p2p_s`, as tp's collectives do (cost.py).

Offload (parallel/offload.py): a block that is offloaded (not recomputed) keeps its saved tensors
in host memory from its forward to its backward. On the device: the stage's activations less
those blocks', plus `RETURNED` blocks' worth (the one whose backward runs and the one prefetched
for the next; the last forward's copies in flight at the peak are one of these). A block's bytes
come from the stage traced with no block recomputed and with every block recomputed (which keeps
only each block's input). On the host: those bytes for every microbatch the schedule keeps in
flight. The copies run at `HOST_GBS` per direction (a stated assumption: pinned copies over a
PCIe Gen4/5 x16 link, as measured commonly; not calibrated) on a side stream, so only what exceeds
the compute they overlap shows: device to host under the forward (a third of a microbatch's
compute), host to device under the backward (two thirds). A CPU plan offers no offload: its
"host" is its device, so nothing is freed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshrun.config.schema import Config
from meshrun.hardware.precision import DTYPES
from meshrun.models.hf_config import is_hf, load_hf_config
from meshrun.parallel.offload import wants_offload
from meshrun.parallel.recompute import wants_recompute
from meshrun.planner.cost import Efficiency, Hardware, rank_compute_s, ring_s
from meshrun.planner.memory import RankMemory, in_flight_bytes
from meshrun.planner.stage_profile import StageProfile

HOST_GBS = 25.0  # pinned host <-> device copies per direction, GB/s (assumed; see the module docstring)
RETURNED = 2  # offloaded blocks' tensors on the device at once in backward: the one running, the one prefetched
Profiles = Callable[[Config], list[StageProfile]]  # a layout's stages' profiles (search.stage_profiles)


def one_rank_of_cp(cfg: Config) -> Config:
    """The config whose stages hold what one cp rank's hold: model.seq_len / cp positions."""
    model = cfg.model.model_copy(update={"seq_len": cfg.model.seq_len // cfg.parallel.cp})
    return cfg.model_copy(update={"model": model})


def context_stages(cfg: Config, stages: list[StageProfile], profiles: Profiles, precision: str) -> list[StageProfile]:
    """`stages` (traced over the whole sequence) with one cp rank's activations and sizes: those
    of stages traced at seq_len / cp (the module docstring says why that is what a cp rank keeps),
    plus, in the built-in GPT, one copy of attention's output per block that keeps its tensors: the
    second all-to-all returns it heads-major, so the projection's input is a copy where one process
    saves a view of attention's own output (measured: a real cp2 step's saved tensors)."""
    if cfg.parallel.cp == 1:
        return stages
    short = profiles(one_rank_of_cp(cfg))
    kept = ("boundary_bytes", "hidden_bytes", "backward_bytes")
    copy = _attention_bytes(cfg, precision)[0] if cfg.model.family == "gpt" else 0
    return [
        dataclasses.replace(
            s,
            **{f: getattr(c, f) for f in kept},
            activation_bytes=c.activation_bytes + (s.blocks - s.recomputed_blocks) * copy,
        )
        for s, c in zip(stages, short, strict=True)
    ]


def attention_widths(cfg: Config) -> tuple[int, int]:
    """Features per position of q and of each of k and v (heads x head dim, before tp)."""
    if is_hf(cfg.model):
        config = load_hf_config(cfg.model)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    dim = getattr(cfg.model, "dim")  # noqa: B009 (cp runs the built-in gpt or HF decoders only)
    return dim, dim


def _attention_bytes(cfg: Config, precision: str) -> tuple[int, int]:
    """Bytes of one microbatch's q and of each of k and v on a tp and cp rank (T / cp positions)."""
    par = cfg.parallel
    q_width, kv_width = attention_widths(cfg)
    positions = cfg.train.micro_batch * cfg.model.seq_len // par.cp
    size = DTYPES[precision].itemsize if precision in DTYPES else 4
    q, kv = (positions * width // par.tp * size for width in (q_width, kv_width))
    return q, kv


def context_s(cfg: Config, held: list[StageProfile], precision: str, *, hw: Hardware, eff: Efficiency) -> float:
    """Seconds of one microbatch's cp all-to-alls on a rank holding `held` (module docstring)."""
    par = cfg.parallel
    if par.cp == 1:
        return 0.0
    q, kv = _attention_bytes(cfg, precision)
    gbs = hw.link_gbs(par.cp * par.tp)
    exchange = 2 * ring_s(q, par.cp, gbs, 1.0) + 2 * ring_s(kv, par.cp, gbs, 1.0) + 4 * eff.p2p_s
    forwards = sum(s.blocks + s.recomputed_blocks for s in held)
    return forwards * (exchange + eff.p2p_s) + sum(s.blocks for s in held) * exchange


def offloaded(cfg: Config, layers: list[int]) -> int:
    """How many of `layers` offload (offload's choice, less the blocks recompute takes)."""
    policy = cfg.train.offload_activations
    return sum(wants_offload(policy, i) and not wants_recompute(cfg.recompute, i) for i in layers)


def block_bytes(cfg: Config, layers: list[list[int]], profiles: Profiles) -> list[int]:
    """Per stage, the bytes one plain block saves: the stage without recompute less the stage with
    every block recomputed (its input held per block), over its blocks."""
    plain = profiles(cfg.model_copy(update={"recompute": "none"}))
    full = profiles(cfg.model_copy(update={"recompute": "full"}))
    inputs = [s.hidden_bytes // (cfg.parallel.tp if cfg.parallel.sequence_parallel else 1) for s in full]
    return [
        max(0, (p.activation_bytes - f.activation_bytes) // max(1, len(held)) + i)
        for p, f, i, held in zip(plain, full, inputs, layers, strict=True)
    ]


def offload_stages(
    cfg: Config, stages: list[StageProfile], layers: list[list[int]], profiles: Profiles
) -> tuple[list[StageProfile], list[int]]:
    """`stages` with their offloaded blocks' bytes off the device (`RETURNED` blocks back), and
    per stage the bytes one microbatch keeps in host memory."""
    if cfg.train.offload_activations is False:
        return stages, [0] * len(stages)
    per_block = block_bytes(cfg, layers, profiles)
    counts = [offloaded(cfg, held) for held in layers]
    host = [n * b for n, b in zip(counts, per_block)]
    device = [
        dataclasses.replace(s, activation_bytes=max(0, s.activation_bytes - h + min(n, RETURNED) * b))
        for s, h, n, b in zip(stages, host, counts, per_block)
    ]
    return device, host


def with_host(cfg: Config, ranks: list[RankMemory], host: list[int]) -> list[RankMemory]:
    """Each pp rank's memory with its host bytes: its stages' per microbatch, for as many
    microbatches as its schedule keeps in flight (memory.py)."""
    par = cfg.parallel
    out = []
    for r, rank in enumerate(ranks):
        held = [host[i] for i in cfg.layout.stages_of(r)]
        kept, _ = in_flight_bytes(par.schedule, held, rank=r, pp=par.pp, m=cfg.accumulation_steps)
        out.append(dataclasses.replace(rank, host=kept))
    return out


def host_copy_s(host: list[int], compute: float, *, hw: Hardware) -> float:
    """Seconds one microbatch's offload copies add to a rank holding stages of `host` bytes and
    `compute` seconds of it (module docstring: on a side stream, under the compute they overlap)."""
    if hw.name == "cpu" or not any(host):
        return 0.0
    copy = sum(host) / (HOST_GBS * 1e9)
    return max(0.0, copy - compute / 3) + max(0.0, copy - 2 * compute / 3)


def long_context_s(
    cfg: Config,
    stages: list[StageProfile],
    host: list[int],
    precision: str,
    *,
    hw: Hardware,
    eff: Efficiency,
    compute_factor: float,
) -> tuple[list[float], list[float]]:
    """Per pp rank, one microbatch's cp all-to-all seconds and offload's exposed copy seconds."""
    total_units = sum(s.units for s in stages)
    tokens = cfg.train.micro_batch * cfg.model.seq_len // cfg.parallel.cp
    context, copies = [], []
    for r in range(cfg.parallel.pp):
        local = cfg.layout.stages_of(r)
        held = [stages[i] for i in local]
        context.append(context_s(cfg, held, precision, hw=hw, eff=eff))
        compute = compute_factor * rank_compute_s(held, total_units, tokens, eff.flops_per_s(hw), eff)
        copies.append(host_copy_s([host[i] for i in local], compute, hw=hw))
    return context, copies
