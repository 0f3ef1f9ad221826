"""The shapes tp's collectives give one tp rank's forward, emulated for the planner's trace.

The planner traces a stage under fake tensors with its parameters shrunk to a rank's shards and
no collectives (stage_cost.py), so forward hooks on the modules the plan names reproduce what the
collectives would hand on: a `colwise_gathered` output all-gathered to the whole width (OLMo 2's
q and k, for their whole-width norms) and a `sliced_output` cut back to this rank's columns.
Under `parallel.sequence_parallel` a tp rank holds 1/tp of each sample's positions between the
embedding and the head (parallel/tensor.py SEQUENCE_STYLES): a scatter or a row-parallel output
(reduce-scattered) is cut to T/tp positions, a gather module's input (attention, the MLP, the
head) repeated back to the whole sequence. Each result is a new tensor, as a collective's is, so
what autograd saves has the sizes one rank keeps: a norm's input T/tp, a gathered matmul input
whole. Only the trace's copy of the stage gets the hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch

import torch
from torch import nn

from meshrun.models.protocol import tp_plan

# style -> how many leading hidden states of the module's output are split by position
_SPLIT_OUTPUT = {"scatter": 1, "vocab_embedding_scatter": 1, "rowwise": 1, "scatter_state": 2}
# style -> how many leading positional inputs are gathered whole (a keyword one: gather_hidden_states)
_GATHER_INPUT = {"gather": 1, "vocab_head": 1, "tied_vocab_head": 1, "gather_pair": 2}


def emulate_tp_shapes(
    part: nn.Module, tp: int, *, sequence_parallel: bool, on_saved: Callable[[object], None] | None = None
) -> None:
    """Hooks on `part`'s modules that give its forward the shapes one of `tp` ranks computes on
    (under sequence parallel the stage is told the split, as apply_tensor_parallel tells it:
    rotary tables cover the whole sequence attention gathers). `on_saved` (selective recompute)
    is handed each row-parallel sum: the policy keeps a collective's output (parallel/recompute.py)."""
    plan = tp_plan(part) or {}
    if sequence_parallel:
        setattr(part, "sequence_shards", tp)  # noqa: B010 (nn.Module types its attributes as tensors or modules)
    for name, module in part.named_modules():
        for style in (style for pattern, style in plan.items() if fnmatch(name, pattern)):
            if style == "colwise_gathered":
                module.register_forward_hook(lambda _m, _i, out: _whole(out, tp, dim=-1))
            elif style == "sliced_output":
                module.register_forward_hook(lambda _m, _i, out: _part(out, tp, dim=-1))
            elif style == "rowwise" and on_saved is not None:
                module.register_forward_hook(_kept_sum(tp, sequence_parallel, on_saved))
            elif not sequence_parallel:
                continue
            elif style in _SPLIT_OUTPUT:
                n = _SPLIT_OUTPUT[style]
                module.register_forward_hook(lambda _m, _i, out, n=n: _map(out, n, lambda x: _part(x, tp, dim=1)))
            elif style in _GATHER_INPUT:
                n = _GATHER_INPUT[style]
                module.register_forward_pre_hook(lambda _m, args, n=n: _map(args, n, lambda x: _whole(x, tp, dim=1)))
            elif style == "gather_hidden_states":
                module.register_forward_pre_hook(_gather_keyword(tp), with_kwargs=True)


def _kept_sum(tp: int, sequence_parallel: bool, on_saved: Callable[[object], None]) -> Callable:
    """A row-parallel output summed over the tp ranks, a new tensor (an all-reduce's; a
    reduce-scatter's T/tp positions under sequence parallel), handed to `on_saved`."""

    def hook(_module: nn.Module, _args: tuple, out: object) -> object:
        summed = _map(out, 1, lambda x: _part(x, tp, dim=1) if sequence_parallel else x.clone())
        on_saved(summed if isinstance(summed, torch.Tensor) else summed[0])  # pyright: ignore[reportIndexIssue]
        return summed

    return hook


def _gather_keyword(tp: int) -> Callable:
    """A pre-hook gathering the keyword input `hidden_states` (transformers' attention)."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "hidden_states": _whole(kwargs["hidden_states"], tp, dim=1)}

    return hook


def _map(value: object, n: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """`fn` applied to a tensor, or to the first `n` floating tensors of a tuple (a mask stays)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    assert isinstance(value, tuple)
    return tuple(
        fn(x) if i < n and isinstance(x, torch.Tensor) and x.is_floating_point() else x for i, x in enumerate(value)
    )


def _part(x: torch.Tensor, tp: int, *, dim: int) -> torch.Tensor:
    """This rank's 1/tp of `dim` (positions, or columns), in storage of its own (as a reduce-scatter's)."""
    return x.narrow(dim, 0, x.shape[dim] // tp).clone()


def _whole(x: torch.Tensor, tp: int, *, dim: int) -> torch.Tensor:
    """All of `dim` back (the sequence, or the width), a new tensor (what an all-gather returns)."""
    return torch.cat([x] * tp, dim=dim)
