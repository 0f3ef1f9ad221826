"""The shapes tp's collectives give one tp rank's forward, emulated for the planner's trace.

The planner traces a stage under fake tensors with its parameters shrunk to a rank's shards
(`shrink_to_tp_shard`) and no collectives (stage_cost.py), so hooks on the modules the plan names
reproduce what the collectives would hand on. Each style's record says what (parallel/tp_styles.py:
`takes`, `hands_on`): a `colwise_gathered` output all-gathered to the whole width (OLMo 2's q and
k, for their whole-width norms) and a `sliced_output` cut back to this rank's columns; under
`parallel.sequence_parallel`, where a tp rank holds 1/tp of each sample's positions between the
embedding and the head, a scatter or a row-parallel output (reduce-scattered) cut to T/tp
positions, a gather module's input (attention, the MLP, the head) repeated back to the whole
sequence. Each result is a new tensor, as a collective's is, so what autograd saves has the sizes
one rank keeps: a norm's input T/tp, a gathered matmul input whole. Only the trace's copy of the
stage gets the hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch
from functools import partial

import torch
from torch import nn

from meshrun.models.protocol import tp_local, tp_plan
from meshrun.parallel.tensor import split_dims
from meshrun.parallel.tp_styles import TP_STYLES, Resize


def shrink_to_tp_shard(part: nn.Module, tp: int) -> None:
    """Give each parameter the model's tp plan splits its shard's shape (meta device), so a forward
    traced on the part computes what one tp rank computes: column-split matmuls make 1/tp of the
    heads and MLP features (models size heads with -1, or take their share in `tp_local`, as
    apply_tensor_parallel has them), the head 1/tp of the vocabulary."""
    if tp > 1:
        tp_local(part, tp)
    shrunk: dict[int, nn.Parameter] = {}  # a tied matrix stays one parameter
    for name, dim in split_dims(part, tp).items():
        module_name, _, param_name = name.rpartition(".")
        module = part.get_submodule(module_name)
        param = getattr(module, param_name, None)
        if not isinstance(param, nn.Parameter):
            continue
        if id(param) not in shrunk:
            shape = list(param.shape)
            shape[dim] = -(-shape[dim] // tp)
            shrunk[id(param)] = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=param.requires_grad)
        setattr(module, param_name, shrunk[id(param)])


def emulate_tp_shapes(
    part: nn.Module,
    tp: int,
    *,
    sequence_parallel: bool,
    experts_over_tp: bool = False,
    on_saved: Callable[[object], None] | None = None,
) -> None:
    """Hooks on `part`'s modules that give its forward the shapes one of `tp` ranks computes on
    (under sequence parallel the stage is told the split, as apply_tensor_parallel tells it:
    rotary tables cover the whole sequence attention gathers; where parallel.ep spans tp a MoE block
    takes the rank's own positions, as apply_tensor_parallel's `experts_over_tp`). `on_saved`
    (selective recompute) is handed the output of each style whose sum over tp the policy keeps
    (parallel/recompute.py)."""
    plan = tp_plan(part) or {}
    if sequence_parallel:
        setattr(part, "sequence_shards", tp)  # noqa: B010 (nn.Module types its attributes as tensors or modules)
    for name, module in part.named_modules():
        for style in (style for pattern, style in plan.items() if fnmatch(name, pattern)):
            form = TP_STYLES[style].form(sequence_parallel, experts_over_tp=experts_over_tp)
            if (takes := form.takes) is not None and takes.keyword is not None:
                module.register_forward_pre_hook(_resize_keyword(takes, tp), with_kwargs=True)
            elif takes is not None:
                module.register_forward_pre_hook(lambda _m, args, takes=takes: _map(args, takes, tp))
            if on_saved is not None and TP_STYLES[style].kept_by_selective:
                module.register_forward_hook(_kept_sum(form.hands_on, tp, on_saved))
            elif (hands_on := form.hands_on) is not None:
                module.register_forward_hook(lambda _m, _i, out, hands_on=hands_on: _map(out, hands_on, tp))


def _kept_sum(hands_on: Resize | None, tp: int, on_saved: Callable[[object], None]) -> Callable:
    """A module's output summed over the tp ranks, a new tensor (an all-reduce's, or as
    `hands_on` resizes it: a reduce-scatter's T/tp positions), handed to `on_saved`."""

    def hook(_module: nn.Module, _args: tuple, out: object) -> object:
        if hands_on is not None:
            summed = _map(out, hands_on, tp)
        else:  # an all-reduce: the whole output, in storage of its own
            summed = out.clone() if isinstance(out, torch.Tensor) else out
        on_saved(summed if isinstance(summed, torch.Tensor) else summed[0])  # pyright: ignore[reportIndexIssue]
        return summed

    return hook


def _resize_keyword(resize: Resize, tp: int) -> Callable:
    """A pre-hook resizing the input passed by keyword `resize.keyword` (transformers' attention
    takes `hidden_states`)."""
    key = resize.keyword

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, key: _map(kwargs[key], resize, tp)}

    return hook


def _map(value: object, resize: Resize, tp: int) -> object:
    """A tensor resized, or the first `resize.count` floating tensors of a tuple (a mask stays)."""
    fn = partial(_whole if resize.whole else _part, tp=tp, dim=resize.dim)
    if isinstance(value, torch.Tensor):
        return fn(value)
    assert isinstance(value, tuple)
    return tuple(
        fn(x) if i < resize.count and isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for i, x in enumerate(value)
    )


def _part(x: torch.Tensor, tp: int, *, dim: int) -> torch.Tensor:
    """This rank's 1/tp of `dim` (positions, or columns), in storage of its own (as a reduce-scatter's)."""
    return x.narrow(dim, 0, x.shape[dim] // tp).clone()


def _whole(x: torch.Tensor, tp: int, *, dim: int) -> torch.Tensor:
    """All of `dim` back (the sequence, or the width), a new tensor (what an all-gather returns)."""
    return torch.cat([x] * tp, dim=dim)
