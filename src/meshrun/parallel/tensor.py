"""Tensor parallelism (`parallel.tp`): the model's declared split (`tp_plan`, models/protocol.py)
applied with torch.distributed.tensor.parallel over the layout's tp mesh, and the
vocabulary-parallel loss.

Megatron's split: column-parallel q, k, v and MLP input, row-parallel output projections (one
all-reduce per attention and per MLP, forward and backward), the embedding and the head split by
vocabulary. What each of the plan's styles applies is its record's (tp_styles.py). The head's
logits stay sharded by vocabulary and `loss_parallel` computes the cross entropy from the shards
(never gathering B x T x V). Activations between blocks, and so between pipeline stages, are
plain replicated tensors (without sequence parallel). The vocabulary need not divide by tp:
DTensor shards unevenly (torch.chunk's split) and the embedding's and the loss's masks follow the
shards.

Sequence parallel (`parallel.sequence_parallel`, Megatron's): the residual stream is split by
position from the embedding's output to the head's input, so norms and dropout hold 1/tp of the
activations; a row-parallel output is reduce-scattered to the positions instead of all-reduced, and
attention and the MLP all-gather their input (together the bytes of the all-reduce they replace).
The plan's scatter, norm and gather styles (and their variants for an embedding, a keyword input,
a state tuple) say where; pipeline stages pass a rank's positions, and the stage is told the split
(`sequence_shards`) so rotary embeddings still cover the whole sequence attention gathers.

Dropout where a rank holds its own heads or positions draws from a stream of its own (tp_rng.py).

Parameters the plan leaves whole (norms, position embeddings) become replicated DTensors: their
gradients are equal on every tp rank, and a replicated DTensor's norm counts them once
(fsdp.full_norm reduces the shards'). A module of a `keeps_plain` style (a MoE block) keeps plain
parameters, equal on every tp rank: routing, dispatch and expert parallelism's all-to-alls run on
plain tensors. Fused AdamW, clipping and the fp16 scaler take each mesh's parameters, and the plain
ones, apart (optim.by_mesh): their foreach kernels take no mix.
"""

from __future__ import annotations

import contextlib
from fnmatch import fnmatch
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from meshrun.errors import ConfigError
from meshrun.models.lora import is_lora_layer
from meshrun.models.protocol import tp_local, tp_plan
from meshrun.parallel.loss_fn import LossFn
from meshrun.parallel.tp_rng import use_rank_streams
from meshrun.parallel.tp_styles import TP_STYLES, AdaptedLinear, TPStyle, local_outputs


def split_dims(part: nn.Module, tp: int) -> dict[str, int]:
    """The dimension the model's tp plan splits, per parameter name (parameters left whole are absent)."""
    plan = tp_plan(part) if tp > 1 else None
    split: dict[str, int] = {}
    for name, module in part.named_modules():
        for pattern, style in (plan or {}).items():
            if fnmatch(name, pattern):
                split |= {f"{name}.{param}": dim for param, dim in _param_split(module, TP_STYLES[style]).items()}
    return split


def _param_split(module: nn.Module, style: TPStyle) -> dict[str, int]:
    """The dimension `style` splits, per parameter name below `module` (a LoRA-wrapped Linear: its
    base's and adapter's, as the style's `adapted` record says)."""
    if style.adapted is None or not is_lora_layer(module):
        return dict(style.split)
    names = [name for name, _ in module.named_parameters()]
    return {name: dim for pattern, dim in style.adapted.split.items() for name in names if fnmatch(name, pattern)}


def _applied(module: nn.Module, style: TPStyle, sequence_parallel: bool, experts_over_tp: bool) -> ParallelStyle | None:
    """The DTensor style applied to `module` (None: nothing): a LoRA-wrapped Linear gets its
    style's `adapted` split (check_adapters_split refused styles without one)."""
    if style.adapted is not None and is_lora_layer(module):
        return AdaptedLinear(style.adapted, sequence_parallel=sequence_parallel)
    make = style.form(sequence_parallel, experts_over_tp=experts_over_tp).make
    return None if make is None else make()


def shard_numels(part: nn.Module, tp: int) -> dict[str, int]:
    """Elements of each parameter on the tp rank that holds the most (the first: torch.chunk's
    split gives it the ceiling), by name; the whole tensor for what the plan leaves whole. Works on
    the meta device: the planner and --dry-run size a tp stage with it."""
    split = split_dims(part, tp)
    numels = {}
    for name, p in part.named_parameters():
        dim = split.get(name)
        numels[name] = p.numel() if dim is None else p.numel() // p.shape[dim] * -(-p.shape[dim] // tp)
    return numels


def check_plan(model: nn.Module, tp: int, source: str, *, sequence_parallel: bool = False) -> None:
    """Before spawn (tp > 1): a plan of known styles that names modules the model has (and, for
    sequence parallel, says where the split starts)."""
    plan = tp_plan(model)
    if plan is None:
        raise ConfigError(
            f"parallel.tp {tp}: {source} declares no tensor-parallel plan (tp_plan); "
            "give it one (models/protocol.py), use a model that has one (model.name gpt, encdec, encoder or "
            "timeseries, or a Hugging Face model), or set parallel.tp=1"
        )
    if sequence_parallel and not any(TP_STYLES[s].starts_sequence_split for s in plan.values() if s in TP_STYLES):
        raise ConfigError(
            f"parallel.sequence_parallel: {source}'s tp_plan has no scatter, norm and gather styles "
            "(where activations are split by sequence); set parallel.sequence_parallel=false"
        )
    names = [name for name, _ in model.named_modules()]
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ConfigError(
                f"{source}'s tp_plan gives {pattern} style {style!r}: choose one of {', '.join(TP_STYLES)}"
            )
        if not any(fnmatch(name, pattern) for name in names):
            raise ConfigError(f"{source}'s tp_plan names {pattern}, which matches no module of the model; fix the plan")


def check_adapters_split(model: nn.Module) -> None:
    """Before spawn (model.lora, tp > 1; `model` whole, adapters added): every adapted layer the tp
    plan splits is split by a style that splits its adapter too (column- and row-parallel ones)."""
    plan = tp_plan(model) or {}
    for name, module in model.named_modules():
        styles = [style for pattern, style in plan.items() if fnmatch(name, pattern)]
        if is_lora_layer(module) and any(TP_STYLES[style].adapted is None for style in styles):
            raise ConfigError(
                f"model.lora.target_modules names {name}, which parallel.tp splits as {styles[0]}: adapters are "
                "split with column- and row-parallel layers only; leave it out of target_modules or set parallel.tp=1"
            )


def apply_tensor_parallel(
    part: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False, experts_over_tp: bool = False
) -> None:
    """Split this stage's modules over the tp mesh as the model's plan says (patterns matching
    nothing here belong to other pipeline stages). Every tp rank holds the same initialised
    values: each keeps its slice, so a shard equals that slice of what one process draws.
    `experts_over_tp`: parallel.ep spans the tp ranks (a MoE block on each rank's own tokens)."""
    plan = tp_plan(part)
    assert plan is not None  # check_plan refused tp > 1 without one
    tp_local(part, tp_mesh.size())
    modules = dict(part.named_modules())
    concrete = {
        name: applied
        for pattern, style in plan.items()
        for name, module in modules.items()
        if fnmatch(name, pattern)
        and (applied := _applied(module, TP_STYLES[style], sequence_parallel, experts_over_tp)) is not None
    }
    frozen = {name for name, param in part.named_parameters() if not param.requires_grad}  # model.lora's base
    parallelize_module(part, tp_mesh, concrete)
    for name, param in part.named_parameters():  # torch's SequenceParallel remakes a norm's weight trainable
        param.requires_grad_(name not in frozen)
    use_rank_streams(
        part, plan, tp_rank=tp_mesh.get_local_rank(), tp=tp_mesh.size(), sequence_parallel=sequence_parallel
    )
    if sequence_parallel:  # what a stage's forward receives holds 1/tp of the positions (protocol.py)
        setattr(part, "sequence_shards", tp_mesh.size())  # noqa: B010 (nn.Module types its attributes as tensors or modules)
    for param in part.parameters():
        if param.requires_grad and isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
            param.register_hook(partial(_sharded_like_param, placements=param.placements))
    plain = _kept_plain(plan, list(modules))
    for name, module in modules.items():
        if name not in plain and any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            # torch annotates the hooks as returning None but uses what they return (as nn.Module hooks do)
            distribute_module(
                module,
                tp_mesh,
                input_fn=_replicated_inputs,  # pyright: ignore[reportArgumentType]
                output_fn=local_outputs,  # pyright: ignore[reportArgumentType]
            )


def _kept_plain(plan: dict[str, str], names: list[str]) -> set[str]:
    """The modules among `names` a `keeps_plain` style (a MoE block) covers, with everything below them."""
    roots = [
        name
        for pattern, style in plan.items()
        if TP_STYLES[style].keeps_plain
        for name in names
        if fnmatch(name, pattern)
    ]
    return {name for name in names for root in roots if name == root or name.startswith(f"{root}.")}


def _sharded_like_param(grad: torch.Tensor, *, placements: tuple) -> torch.Tensor:
    """A sharded parameter's gradient as its own shard. DTensor's embedding backward returns the
    vocabulary-split weight's gradient replicated (the whole V x C on every tp rank, kept until
    the optimizer steps); its rows are exact, so keeping this rank's is a slice, no collective."""
    if isinstance(grad, DTensor) and grad.placements != placements and all(p.is_replicate() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def _replicated_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """A module the plan leaves whole computes on replicated DTensors (its inputs are equal on every
    tp rank), inside a tuple too (a model's state between blocks: encdec's final norm takes one)."""
    return tuple(
        _replicated_inputs(module, x, mesh)
        if isinstance(x, tuple)
        else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def vocab_parallel(tp: int) -> contextlib.AbstractContextManager:
    """The context a forward + loss + backward runs in: loss_parallel under tp (the cross entropy
    of vocabulary-sharded logits, forward and backward), nothing otherwise."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def tp_loss(loss: LossFn, tp: int) -> LossFn:
    """The loss a step under `tp` calls: its value as a plain tensor (LocalLoss) when tp > 1."""
    return LocalLoss(loss) if tp > 1 else loss


class LocalLoss:
    """A loss over vocabulary-sharded logits, returned as a plain tensor (every tp rank holds the
    same value), so schedules, accumulation and logging see what they see without tp."""

    def __init__(self, loss: LossFn) -> None:
        self.loss = loss

    @property
    def num_microbatches(self) -> int:
        return self.loss.num_microbatches

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = self.loss(logits, targets)
        # a copy, not to_local's view: split-backward schedules (zbv, zero-bubble) detach the loss in place
        return value.to_local().clone() if isinstance(value, DTensor) else value

    def unscaled(self, losses: list[torch.Tensor]) -> torch.Tensor:
        return self.loss.unscaled(losses)
