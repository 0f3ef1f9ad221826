"""What one pipeline stage costs: exact state bytes, traced activation bytes, FLOPs.

State bytes come from the real model built on the meta device (the same `build_stage` the
trainer uses), so they are exact: fp32 parameters, fp32 gradients, and fused AdamW's two fp32
moments plus one fp32 step counter per parameter tensor. Activation bytes are what one
microbatch keeps for backward: one forward (and the loss, on the last stage) traced under fake
tensors on the CPU (shapes and kernel choices only, no memory), counted by `SavedBytes`. Under
tp the traced parameters have their shard's shape and the collectives' results are emulated
(tp_shapes.py: gathered widths, under sequence parallel the split of the positions), so what is
traced is one tp rank's forward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json

import torch
from torch import nn

from meshrun.config.schema import Config, TrainConfig
from meshrun.hardware.precision import DTYPES
from meshrun.models.families import flops_at
from meshrun.models.moe import sparse_mlps
from meshrun.models.protocol import ProtocolModule
from meshrun.models.task_io import task_io
from meshrun.parallel.materialise import build_stage, prune_stage
from meshrun.parallel.recompute import apply_recompute, wants_recompute
from meshrun.parallel.tensor import shard_numels
from meshrun.planner.fake_cpu import fake_cpu
from meshrun.planner.saved_bytes import SavedBytes
from meshrun.planner.stage_pieces import compose, consecutive
from meshrun.planner.stage_profile import StageProfile
from meshrun.planner.tp_shapes import emulate_tp_shapes, shrink_to_tp_shard
from meshrun.tasks import task_for
from meshrun.training.loss import MicrobatchLoss

Spec = tuple  # (shape, dtype) of a stage's output, or a tuple of those (a model handing on a state)


def state_bytes(part: nn.Module, train: TrainConfig, tp: int = 1) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes of a stage on one rank, exactly as training
    allocates them: each tensor the model's tp plan splits counted as its largest shard, the
    optimizer's state as `train.optimizer_state` says that optimizer keeps it."""
    numels = shard_numels(part, tp)
    params = list(part.named_parameters())
    trainable = [(n, p) for n, p in params if p.requires_grad]
    param_bytes = sum(numels[n] * p.element_size() for n, p in params)
    grad_bytes = sum(numels[n] * p.element_size() for n, p in trainable)
    per_value, per_tensor = train.optimizer_state()
    return param_bytes, grad_bytes, per_value * grad_bytes + per_tensor * len(trainable)


def _amp(precision: str) -> contextlib.AbstractContextManager:
    dtype = DTYPES.get(precision, torch.float32)  # auto was resolved before; fp32 runs without autocast
    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def attention_per_block(cfg: Config, whole: ProtocolModule) -> float:
    """The whole model's training FLOPs per token (`flops_at`: model.lora's count for a model with
    adapters) less its matmul weights' (_matmul_flops), per block: attention's."""
    return max(0.0, flops_at(whole, cfg.model.seq_len) - _matmul_flops(cfg, whole)) / len(whole.blocks)


def _matmul_flops(cfg: Config, module: ProtocolModule) -> float:
    """Training FLOPs per token of the module's matmul weights: 6 per trained weight, 4 per frozen
    one (model.lora's base: its forward and its input's gradient, no gradient of its own;
    models/lora.py's flops_per_token). The embedding's tables are lookups (none; a Linear in it, a
    projection of values, counts), and the head's count as the share of positions it maps
    (task_io.py: a pooled or last-step head runs once per sample, so B x hidden x labels is
    1/seq_len of a token's); MoE experts count their active share (expert_shares)."""
    lookups: set[int] = set()
    if module.embed is not None:
        projections = {id(p) for m in module.embed.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
        lookups = {id(p) for p in module.embed.parameters()} - projections
    head = {id(p) for p in module.head.parameters()} if module.head is not None else set()
    share = task_io(cfg).head_positions / cfg.model.seq_len
    active = expert_shares(module.blocks)
    return sum(
        (6.0 if p.requires_grad else 4.0) * p.numel() * (share if id(p) in head else active.get(id(p), 1.0))
        for p in module.parameters()
        if id(p) not in lookups
    )


def expert_shares(blocks: nn.ModuleDict) -> dict[int, float]:
    """id of each MoE expert weight -> the share of it a token runs through (top_k / E): MoE compute
    is priced at active parameters, as MFU counts them (models/moe.py's inactive_params)."""
    return {
        id(p): mlp.gate.top_k / mlp.gate.num_experts
        for mlp in sparse_mlps(blocks).values()
        for p in mlp.experts.parameters()
    }


def stage_flops_per_token(cfg: Config, part: ProtocolModule, attention: float) -> tuple[float, float]:
    """The whole model's training FLOPs per token shared out: its matmul weights' (6 per trained
    weight, 4 per frozen one: see _matmul_flops) to the stage that holds them, the rest
    (`attention`, per block: see attention_per_block) evenly over blocks; recomputed blocks add
    their forward again (2 per weight, trained or frozen, and a third of attention's)."""
    useful = _matmul_flops(cfg, part) + attention * len(part.blocks)
    active = expert_shares(part.blocks)
    extra = sum(
        2.0 * sum(p.numel() * active.get(id(p), 1.0) for p in block.parameters()) + attention / 3
        for key, block in part.blocks.items()
        if wants_recompute(cfg.recompute, int(key))
    )
    return useful + extra, useful


def tp_rank_flops(
    cfg: Config, part: ProtocolModule, attention: float, tp: int, *, experts_over_tp: bool
) -> dict[str, float]:
    """One tp rank's FLOPs per token of the stage (StageProfile's fields): 1/tp of the model's work,
    plus, where a MoE block's MLP is whole on every tp rank (parallel.ep not spanning tp), the
    (tp - 1)/tp of that MLP each rank computes again. Where ep spans tp each rank routes its own
    1/tp of the positions: nothing is repeated."""
    flops, useful = stage_flops_per_token(cfg, part, attention)
    shares = {"flops_per_token": flops / tp, "model_flops_per_token": useful / tp}
    if tp == 1 or experts_over_tp:
        return shares
    active = expert_shares(part.blocks)
    repeated = sum(
        ((6.0 if p.requires_grad else 4.0) + 2.0 * wants_recompute(cfg.recompute, index))
        * p.numel()
        * active.get(id(p), 1.0)
        for index, mlp in sparse_mlps(part.blocks).items()
        for p in mlp.parameters()
    )
    return {**shares, "replicated_flops_per_token": repeated * (tp - 1) / tp}


def priced_at_length(cfg: Config, stages: list[StageProfile], length: int) -> list[StageProfile]:
    """`stages` with attention priced at `length` instead of model.seq_len: packed documents'
    rows cost the attention of each document alone (data/packed.py's `attention_length`, the
    length whose causal attention costs what theirs does), as the trainer prices them for MFU.
    Attention's FLOPs per token grow linearly with the length (attention_per_block)."""
    attention = _model_facts(_build_key(_model_json(cfg, cfg.recompute)))[2]
    saved = attention * (1.0 - length / cfg.model.seq_len) / cfg.parallel.tp  # per block and token
    return [
        dataclasses.replace(
            s,
            flops_per_token=s.flops_per_token - saved * (s.blocks + s.recomputed_blocks / 3),
            model_flops_per_token=s.model_flops_per_token - saved * s.blocks,
        )
        for s in stages
    ]


def _block_kind(block: nn.Module) -> tuple:
    """Blocks of one kind (class and parameter shapes) cost the same: one is traced for all."""
    return (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))


@functools.lru_cache(maxsize=4)
def _whole(model_json: str) -> ProtocolModule:
    """The whole model on the meta device, built once per build key (see _build_key): read for its
    blocks' kinds and FLOPs, and copied for each traced piece (_stage_copy)."""
    return build_stage(_config(model_json), layers=None, first=True, last=True)


@functools.lru_cache(maxsize=4)
def _model_facts(model_json: str) -> tuple[int, bool, float]:
    """The whole model's blocks, whether they are all of one kind, and its attention_per_block."""
    whole = _whole(model_json)
    one_kind = len({_block_kind(block) for block in whole.blocks.values()}) == 1
    return len(whole.blocks), one_kind, attention_per_block(_config(model_json), whole)


def _stage_copy(model_json: str, layers: tuple[int, ...], first: bool, last: bool) -> ProtocolModule:
    """A stage of these blocks, as build_stage makes it, from a copy of the whole model that leaves
    the other blocks out (a 7B model is built once, not once per piece)."""
    whole, keep = _whole(model_json), {str(i) for i in layers}
    others = {id(block): block for key, block in whole.blocks.items() if key not in keep}  # shared, then pruned
    return prune_stage(copy.deepcopy(whole, others), layers=list(layers), first=first, last=last)


@functools.lru_cache(maxsize=16)
def _config(model_json: str) -> Config:
    return Config.model_validate_json(model_json)


def _build_key(model_json: str) -> str:
    """A piece's config less its recompute policy: what building the model reads (the policy
    wraps blocks only when traced), so every policy shares one built stage."""
    return json.dumps({**json.loads(model_json), "recompute": "none"}, sort_keys=True)


@functools.lru_cache(maxsize=4096)
def _piece(
    model_json: str,
    micro_batch: int,
    precision: str,
    tp: int,
    sp: bool,
    over_tp: bool,
    layers: tuple[int, ...],
    first: bool,
    last: bool,
    hidden: Spec | None,
) -> tuple[StageProfile, Spec]:
    """One traced stage of these consecutive blocks, receiving `hidden` unless first (and its
    output's shape and dtype). Beyond a micro_batch of 2, from those of 1 and 2: every saved
    tensor has the batch dimension or none (a rotary table), so a microbatch's bytes are affine
    in its size (test_stage_pieces checks)."""
    if micro_batch > 2:
        (one, out), (two, _) = (
            _piece(
                model_json,
                b,
                precision,
                tp,
                sp,
                over_tp,
                layers,
                first,
                last,
                _with_batch(hidden, b) if hidden else None,
            )
            for b in (1, 2)
        )
        grown = dataclasses.replace(
            one,
            activation_bytes=one.activation_bytes + (micro_batch - 1) * (two.activation_bytes - one.activation_bytes),
            boundary_bytes=micro_batch * one.boundary_bytes,
            hidden_bytes=micro_batch * one.hidden_bytes,
            backward_bytes=micro_batch * one.backward_bytes,
        )
        return grown, _with_batch(out, micro_batch)
    cfg = _config(model_json)
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"tp": tp, "sequence_parallel": sp})})
    build = _build_key(model_json)
    part = _stage_copy(build, layers, first, last)
    flops = tp_rank_flops(cfg, part, _model_facts(build)[2], tp, experts_over_tp=over_tp)
    shrink_to_tp_shard(part, tp)
    profile, out = _trace(cfg, part, micro_batch, precision, first=first, last=last, hidden=hidden, over_tp=over_tp)
    return dataclasses.replace(profile, **flops), out


def profile_stages(cfg: Config, split: list[list[int]], micro_batch: int, precision: str) -> list[StageProfile]:
    """Every stage of `split` (blocks per stage, pipeline order) for one microbatch of `micro_batch`,
    on one tp rank: composed from one- and two-block stages (stage_pieces.py) when the blocks are
    all of one kind, else each distinct stage traced whole. `precision` resolved: what the stages
    are built at (a LoRA base's dtype follows it: models/lora.py's base_as_stored)."""
    cfg = cfg.model_copy(update={"precision": precision})
    configs = {policy: _model_json(cfg, policy) for policy in {"none", "full", "every:2", cfg.recompute}}
    num_layers, one_kind, _ = _model_facts(_build_key(configs[cfg.recompute]))
    if num_layers < 2 or not one_kind:
        return _trace_stages(cfg, split, micro_batch, precision)
    flags = [wants_recompute(cfg.recompute, i) for i in range(num_layers)]
    tp, sp = cfg.parallel.tp, cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
    over_tp = cfg.layout.experts_over_tp

    def piece(wanted: tuple, first: bool, last: bool) -> tuple[StageProfile, Spec]:
        policy, layers = _shared_piece(cfg.recompute, wanted, num_layers)
        if policy is None:  # a policy of its own (selective): its own blocks
            policy, layers = cfg.recompute, tuple(consecutive(flags, wanted))
        # a later stage receives what the first stage hands on (blocks of one kind: any stage's output)
        hidden = None if first else piece((flags[0],), True, False)[1]
        return _piece(configs[policy], micro_batch, precision, tp, sp, over_tp, layers, first, last, hidden)

    n = len(split)
    return [
        compose(layers, first=i == 0, last=i == n - 1, flags=flags, trace=lambda *key: piece(*key)[0])
        for i, layers in enumerate(split)
    ]


def _model_json(cfg: Config, recompute: str) -> str:
    """The config a piece depends on: the model and a recompute policy (layout and training reset)."""
    update = {"parallel": type(cfg.parallel)(), "train": type(cfg.train)(), "recompute": recompute}
    return cfg.model_copy(update=update).model_dump_json()


def _shared_piece(policy: str, wanted: tuple[bool, ...], num_layers: int) -> tuple[str | None, tuple[int, ...]]:
    """Plain checkpointing (none, every:k, full) wraps a block the same way whatever the policy, so
    one piece serves them all: blocks all plain under none, all wrapped under full, alternating
    under every:2 from an even (wrapped) or odd block. (None, ()) for other policies."""
    if policy not in ("none", "full") and not policy.startswith("every:"):
        return None, ()
    if len(set(wanted)) == 1:
        return ("full" if wanted[0] else "none"), tuple(range(len(wanted)))
    start = 0 if wanted[0] else 1
    if start + len(wanted) > num_layers:
        return None, ()
    return "every:2", tuple(range(start, start + len(wanted)))


def _trace_stages(cfg: Config, split: list[list[int]], micro_batch: int, precision: str) -> list[StageProfile]:
    """Each distinct stage traced whole (blocks of several kinds): stages alike (first / last,
    their blocks' kinds and recompute) once."""
    whole = build_stage(cfg, layers=None, first=True, last=True)
    kinds = {key: _block_kind(block) for key, block in whole.blocks.items()}
    attention = attention_per_block(cfg, whole)
    num_stages, tp, over_tp = len(split), cfg.parallel.tp, cfg.layout.experts_over_tp
    keys = [
        (i == 0, i == num_stages - 1, tuple((kinds[str(b)], wants_recompute(cfg.recompute, b)) for b in layers))
        for i, layers in enumerate(split)
    ]
    traced: dict[tuple, StageProfile] = {}
    hidden: Spec | None = None  # what a stage hands the next one
    for key, layers in zip(keys, split):
        if key in traced and (key[0] or hidden is not None):
            continue
        part = build_stage(cfg, layers=layers if num_stages > 1 else None, first=key[0], last=key[1])
        flops = tp_rank_flops(cfg, part, attention, tp, experts_over_tp=over_tp)
        shrink_to_tp_shard(part, tp)
        profile, out = _trace(
            cfg, part, micro_batch, precision, first=key[0], last=key[1], hidden=hidden, over_tp=over_tp
        )
        traced[key] = dataclasses.replace(profile, **flops)
        hidden = out if not key[1] else hidden
    return [traced[key] for key in keys]


def _trace(
    cfg: Config,
    part: ProtocolModule,
    micro_batch: int,
    precision: str,
    *,
    first: bool,
    last: bool,
    hidden: Spec | None,
    over_tp: bool = False,
) -> tuple[StageProfile, Spec]:
    """One forward of the stage (and the loss, on the last) under fake tensors: the bytes kept for
    backward, the state bytes and the output's shape and dtype (the next stage's input). Under
    sequence parallel a block's output holds 1/tp of the positions (so does what the stage hands
    on); `hidden_bytes` stays the whole hidden state, the size of the collectives tp runs.
    `over_tp`: parallel.ep spans tp, so a MoE block runs on the rank's own positions."""
    param_bytes, grad_bytes, optimizer_bytes = state_bytes(part, cfg.train)  # already shrunk to one tp rank's shards
    blocks = list(part.blocks.keys())
    recomputed = sum(wants_recompute(cfg.recompute, int(b)) for b in blocks)
    moe = list(sparse_mlps(part.blocks))
    block_out: list[int] = []
    fake = fake_cpu()
    with fake.mode:
        if first:
            x: object = task_io(cfg).inputs.zeros(micro_batch)
        else:
            assert hidden is not None  # stages are traced in pipeline order
            x = _input(hidden)
        fake.to_empty(part)
        tp, sp = cfg.parallel.tp, cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
        counter = SavedBytes(exclude=list(part.parameters()))
        if tp > 1:  # before recompute wraps the blocks: the hooks sit on the modules themselves
            kept = counter.hold_cached if cfg.recompute == "selective" else None
            emulate_tp_shapes(part, tp, sequence_parallel=sp, experts_over_tp=over_tp, on_saved=kept)
        shards = tp if sp else 1
        apply_recompute(part.blocks, cfg.recompute, on_saved=counter.hold_cached)
        first_block = next(iter(part.blocks.values()))
        first_block.register_forward_hook(lambda _m, _i, out: block_out.append(_nbytes(out)))
        counter.count_checkpoint_inputs(part)
        with counter.hooks(), _amp(precision):
            out = part(*x) if isinstance(x, tuple) else part(x)  # a state tuple arrives as arguments
            # the task's loss on targets of the task's shape: what it saves counts (a log-softmax)
            loss = None
            if last:
                targets = task_io(cfg).targets_of(out)
                loss = MicrobatchLoss(1, summed=task_for(cfg.task).summed(cfg))(out, targets)
        profile = StageProfile(
            param_bytes,
            grad_bytes,
            optimizer_bytes,
            activation_bytes=counter.live,
            flops_per_token=0.0,
            model_flops_per_token=0.0,
            boundary_bytes=0 if last else sum(t.numel() * t.element_size() for t in _tensors(out)),
            units=len(blocks) + first + last,
            blocks=len(blocks),
            recomputed_blocks=recomputed,
            moe_blocks=len(moe),
            recomputed_moe_blocks=sum(wants_recompute(cfg.recompute, b) for b in moe),
            hidden_bytes=shards * block_out[0] if block_out else 0,
            backward_bytes=loss_gradient_bytes(out) if last else 0,
        )
        spec = _spec(out)
        del out, loss
    return profile, spec


def loss_gradient_bytes(logits: object) -> int:
    """What the loss's backward allocates at once on the last stage: the fp32 gradient of the
    logits twice over (cross-entropy's nll part hands one to its log-softmax part, which makes
    the next), while every kept activation is still alive. Whatever the task's output (token
    logits, a classifier's (B, labels), a forecast's (B, horizon, features): a regression loss
    makes one gradient, so twice is a bound of a few bytes per sample there). torch's MemTracker reads exactly this
    as a real step's temporaries at its peak (tests/planner/test_memory_model.py); on an H200 it
    was most of what the plan missed (bench/README.md)."""
    tensors = _tensors(logits)
    return 2 * 4 * tensors[0].numel() if tensors else 0


def _spec(out: object) -> Spec:
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape), out.dtype)
    assert isinstance(out, tuple)
    return tuple(_spec(o) for o in out)


def _with_batch(spec: Spec, batch: int) -> Spec:
    if len(spec) == 2 and isinstance(spec[1], torch.dtype):
        return ((batch, *spec[0][1:]), spec[1])
    return tuple(_with_batch(s, batch) for s in spec)


def _input(spec: Spec) -> object:
    """What the next stage receives: zeros of the spec's shapes, floating ones requiring grad."""
    if len(spec) == 2 and isinstance(spec[1], torch.dtype):
        x = torch.zeros(spec[0], dtype=spec[1])
        return x.requires_grad_(True) if x.is_floating_point() else x
    return tuple(_input(s) for s in spec)


def _tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)] if isinstance(out, tuple) else []


def _nbytes(out: object) -> int:
    tensor = out[0] if isinstance(out, tuple) else out
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
