"""Expert parallelism (`parallel.ep`) in the plan: which ep degrees a layout may take, the expert
state each rank holds, and the all-to-alls that carry tokens to their experts.

Routing is planned as balanced: every expert receives top_k x tokens / E rows per microbatch, so
each ep rank computes the rows of top_k x tokens (its own tokens' worth: the FLOPs and saved bytes of
one process's trace, models/moe.py's planned path) and each all-to-all sends (ep - 1) / ep of a rank's
rows away. A real router is not balanced: the busiest ep rank computes, saves and receives more (its
excess is what the balance loss keeps small); the plan says so where it prints.

Per MoE layer and microbatch a rank runs, as parallel/experts.py does: forward, an exchange of the
row counts and two all-to-alls of top_k x tokens x hidden (rows out, results back); backward, two
(their gradients); a recomputed block's forward again. Each costs the ring term at the ep group's link
and the calibrated per-message `p2p_s`, as a tp or dp collective does (planner/cost.py). Once per step
the experts' gradients are summed over ep_dp: an all-reduce of the rank's share, or, where the experts
are FSDP-sharded over ep_dp (dp_mode fsdp / hsdp: `experts_sharded`), their gathers and reduce-scatter
priced as the dense FSDP collectives are.

Under tp a MoE block is whole on every tp rank (parallel/tp_styles.py's `moe_block`): the traced tp
stage holds its router and experts whole and computes it over the whole sequence (under sequence
parallel too), so its state, saved bytes, FLOPs (the (tp - 1) / tp every tp rank repeats are
StageProfile.replicated_flops_per_token: computed, not model FLOPs) and the all-to-alls' rows (the
whole hidden state) are priced undivided by tp, and each tp rank's ep group spans ep x tp neighbouring
ranks; cost.py's tp collectives count attention's alone for a MoE block (its MLP runs none; under
sequence parallel one all-gather each way). Where ep spans tp (ep = tp x a divisor of dp: each tp
rank routes its own positions) the experts' state is split over ep as always, the ep group is ep
neighbouring ranks, each rank's all-to-alls carry 1/tp of the rows, the traced block runs on the
rank's own positions (tp_shapes.py, the `moe_block` style's over-tp forms: its saved bytes and FLOPs
1/tp) and its MLP's tp collectives are one all-gather each way (none under sequence parallel).

Memory: the experts are kept out of the dense weights' DDP / FSDP (no buckets or shards of theirs), so
a rank holds the dense state as dp_mode says and 1 / `expert_split` of the experts' (ep, or dp where
they are sharded over ep_dp too, with FSDP's gather buffers), while the activations are one process's
(balanced routing) plus the combine's copy of the returned rows."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from meshrun.config.schema import Config
from meshrun.models.moe import sparse_mlps
from meshrun.models.protocol import ProtocolModule
from meshrun.parallel.expert_shards import EXPERT_WEIGHTS
from meshrun.parallel.fsdp import reshard_after_forward
from meshrun.parallel.layout import ep_spans_tp
from meshrun.parallel.materialise import build_stage
from meshrun.parallel.recompute import wants_recompute
from meshrun.planner.cost import DataParallel, Efficiency, Hardware, data_parallel, ring_s
from meshrun.planner.memory import RankMemory, comm_buffers
from meshrun.planner.stage_profile import StageProfile


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's experts, whole (all E of them)."""

    param_bytes: int
    grad_bytes: int  # 0 when frozen
    tensors: int  # trainable expert tensors: the optimizer keeps a step count for each, split or not
    top_k: int
    num_experts: int


@functools.lru_cache(maxsize=4)
def _whole(model_json: str) -> ProtocolModule:
    """The whole model on the meta device (shapes only), once per model."""
    return build_stage(Config.model_validate_json(model_json), layers=None, first=True, last=True)


def _model_json(cfg: Config) -> str:
    """The config less its layout and training: what the model's build reads."""
    update = {"parallel": type(cfg.parallel)(), "train": type(cfg.train)(), "recompute": "none"}
    return cfg.model_copy(update=update).model_dump_json()


@functools.lru_cache(maxsize=8)
def _moe_layers(model_json: str) -> dict[int, MoELayer]:
    whole = _whole(model_json)
    layers = {}
    for index, mlp in sparse_mlps(whole.blocks).items():
        weights = [mlp.experts.get_parameter(name) for name in EXPERT_WEIGHTS]
        trained = [w for w in weights if w.requires_grad]
        layers[index] = MoELayer(
            param_bytes=sum(w.numel() * w.element_size() for w in weights),
            grad_bytes=sum(w.numel() * w.element_size() for w in trained),
            tensors=len(trained),
            top_k=int(mlp.gate.top_k),
            num_experts=int(mlp.gate.num_experts),
        )
    return layers


def moe_layers(cfg: Config) -> dict[int, MoELayer]:
    """Block index -> its experts, for the model's MoE layers (empty for a dense model)."""
    return _moe_layers(_model_json(cfg))


def expert_degrees(cfg: Config, dp: int, tp: int = 1) -> list[int]:
    """The ep degrees a layout with `dp` data-parallel and `tp` tensor-parallel ranks may take: divisors
    of dp, and tp times a divisor of dp (ep spanning tp: parallel/layout.py), that divide every MoE
    layer's experts (1 alone for a dense model); within a node or across nodes alike."""
    counts = {layer.num_experts for layer in moe_layers(cfg).values()}
    if not counts:
        return [1]
    fits = (ep for ep in range(1, dp * tp + 1) if dp % ep == 0 or ep_spans_tp(ep, dp, tp))
    return [ep for ep in fits if all(n % ep == 0 for n in counts)]


def experts_sharded(cfg: Config) -> bool:
    """Whether each ep rank's experts are FSDP-sharded over ep_dp as well: under dp_mode fsdp / hsdp with
    ep_dp > 1 (parallel/fsdp.py's wrap_experts: over the whole ep_dp, hsdp too); else replicated there,
    their gradients all-reduced (parallel/experts.py's ExpertGradients)."""
    return cfg.parallel.dp_mode != "ddp" and cfg.layout.size("ep_dp") > 1


def expert_split(cfg: Config) -> int:
    """Ranks each MoE layer's expert state is split over: ep, times ep_dp where they are sharded there
    (experts_sharded): the one place the memory model asks how the experts are kept."""
    return cfg.parallel.ep * (cfg.layout.size("ep_dp") if experts_sharded(cfg) else 1)


def _held(cfg: Config, blocks: list[int]) -> list[MoELayer]:
    layers = moe_layers(cfg)
    return [layers[b] for b in blocks if b in layers]


def dense_stages(cfg: Config, stages: list[StageProfile], split: list[list[int]]) -> list[StageProfile]:
    """Each stage less its experts' state (parameters, gradients, optimizer): what DDP / FSDP hold
    and reduce under ep (`split`: each stage's blocks)."""
    per_value, per_tensor = cfg.train.optimizer_state()
    out = []
    for stage, blocks in zip(stages, split):
        held = _held(cfg, blocks)
        grads = sum(layer.grad_bytes for layer in held)
        out.append(
            dataclasses.replace(
                stage,
                param_bytes=stage.param_bytes - sum(layer.param_bytes for layer in held),
                grad_bytes=stage.grad_bytes - grads,
                optimizer_bytes=stage.optimizer_bytes
                - per_value * grads
                - per_tensor * sum(layer.tensors for layer in held),
            )
        )
    return out


def with_experts(cfg: Config, memory: RankMemory, held: list[tuple[StageProfile, list[int]]]) -> RankMemory:
    """`memory` (a rank's dense state, activations and buffers) plus its share of the experts of the
    stages it holds (`held`: each with its blocks): 1 / expert_split of their state, whole step counts
    (see dense_stages), and what routing adds to each microbatch in flight: the combine's weighting
    keeps the returned rows (top_k x tokens x hidden) of every MoE layer not recomputed, beside the
    same rows the experts' own forward keeps (weighted by ones: parallel/experts.py)."""
    blocks = [b for _, stage_blocks in held for b in stage_blocks]
    layers, share = _held(cfg, blocks), expert_split(cfg)
    per_value, per_tensor = cfg.train.optimizer_state()
    grads = sum(layer.grad_bytes for layer in layers) // share
    returned = max(sum(layer.top_k * stage.hidden_bytes for layer in _kept(cfg, blocks)) for stage, blocks in held)
    buffers = 0
    if experts_sharded(cfg):  # FSDP's gathered expert weights and unsharded gradients, over ep_dp
        ep, ep_dp = cfg.parallel.ep, cfg.layout.size("ep_dp")
        params, ep_grads = (sum(getattr(x, f) for x in layers) // ep for f in ("param_bytes", "grad_bytes"))
        owned = StageProfile(params, ep_grads, 0, 0, 0.0, 0.0, 0, blocks=len(layers))  # an ep rank's, whole
        regather = reshard_after_forward(cfg.parallel)
        buffers = comm_buffers([owned], dp=ep_dp, shard=ep_dp, regather=regather, m=cfg.accumulation_steps)
    return dataclasses.replace(
        memory,
        params=memory.params + sum(layer.param_bytes for layer in layers) // share,
        grads=memory.grads + grads,
        optimizer=memory.optimizer + per_value * grads + per_tensor * sum(layer.tensors for layer in layers),
        activations=memory.activations + memory.in_flight * returned,
        buffers=memory.buffers + buffers,
    )


def _kept(cfg: Config, blocks: list[int]) -> list[MoELayer]:
    """The MoE layers among `blocks` whose tensors backward keeps (not recomputed)."""
    return _held(cfg, [b for b in blocks if not wants_recompute(cfg.recompute, b)])


def expert_parallel_s(
    cfg: Config, stages: list[StageProfile], split: list[list[int]], hw: Hardware, eff: Efficiency
) -> float:
    """One step's ep communication on the busiest pp rank: every microbatch's all-to-alls through its
    MoE layers, then the experts' gradient all-reduce over ep_dp (see the module docstring); 0 at ep 1."""
    par, layout = cfg.parallel, cfg.layout
    if par.ep == 1:
        return 0.0
    over_tp = layout.experts_over_tp  # the ep group: ep neighbouring ranks (whole tp groups), else ep dp ranks apart
    span = par.ep if over_tp else par.ep * par.cp * par.tp
    gbs = hw.link_gbs(span) if hw.gpus_per_node % span == 0 else hw.inter_gbs
    dp_gbs = hw.link_gbs(par.dp * par.cp * par.tp)
    layers = moe_layers(cfg)
    per_rank = []
    for r in range(par.pp):
        seconds = 0.0
        for s in layout.stages_of(r):
            for block in split[s]:
                layer = layers.get(block)
                if layer is None:
                    continue
                forwards = 1 + wants_recompute(cfg.recompute, block)
                rows = layer.top_k * stages[s].hidden_bytes  # top_k x tokens x hidden, per microbatch
                rows //= par.tp if over_tp else 1  # each tp rank routes its own positions
                seconds += (2 * forwards + 2) * (ring_s(rows, par.ep, gbs, 1.0) + eff.p2p_s) + forwards * eff.p2p_s
        held = [layer for s in layout.stages_of(r) for layer in _held(cfg, split[s])]
        per_rank.append(cfg.accumulation_steps * seconds + _expert_sync_s(cfg, held, dp_gbs, eff))
    return max(per_rank)


def _expert_sync_s(cfg: Config, held: list[MoELayer], gbs: float, eff: Efficiency) -> float:
    """One step's traffic over ep_dp for a rank's share of `held`: replicated experts' gradients
    all-reduced at once; sharded ones (experts_sharded) gathered per forward and backward (once a step
    when FSDP keeps them gathered) and reduce-scattered, per layer, as the dense FSDP collectives are
    priced (planner/cost.py's data_parallel)."""
    ep, ep_dp = cfg.parallel.ep, cfg.layout.size("ep_dp")
    params, grads = (sum(getattr(layer, f) for layer in held) / ep for f in ("param_bytes", "grad_bytes"))
    if not experts_sharded(cfg):
        return ring_s(grads, ep_dp, gbs, 2.0) + eff.p2p_s
    over = DataParallel(dp=ep_dp, shard=ep_dp, regather=reshard_after_forward(cfg.parallel))
    seconds, collectives = data_parallel(grads, params, len(held), over, m=cfg.accumulation_steps, gbs=gbs)
    return seconds + collectives * eff.shard_s


def routing_note(cfg: Config) -> str | None:
    """The plan's line on a MoE model: its layers, and the routing balance every figure assumes."""
    layers = moe_layers(cfg)
    if not layers:
        return None
    first = next(iter(layers.values()))
    return (
        f"MoE: {len(layers)} layers of {first.num_experts} experts, top {first.top_k}; planned with balanced routing "
        "(each expert gets top_k x tokens / E rows: a real router's busiest ep rank computes, saves and receives "
        "more); ep: 2 all-to-alls per MoE layer forward and 2 backward, experts split over ep (and over dp / ep "
        "under fsdp / hsdp), computed at active parameters; under tp each MoE block is whole on every tp rank (its "
        "compute, state and all-to-alls not divided by tp) unless ep spans tp (each tp rank then computes and routes "
        "its own 1/tp of the rows)"
    )
