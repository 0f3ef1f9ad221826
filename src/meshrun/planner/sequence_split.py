"""Sequence parallel's split of the positions, emulated on one tp rank's stage for the planner's trace.

Under `parallel.sequence_parallel` a tp rank holds 1/tp of each sample's positions between the
embedding and the head (parallel/tensor.py SEQUENCE_STYLES): a scatter hands on a rank's
positions, norms and dropout run on them, a gather module (attention, the MLP, the head) gets the
whole sequence all-gathered, and a row-parallel output is reduce-scattered back to the positions.
The planner traces a stage under fake tensors without collectives, so forward hooks on the
modules the plan names reproduce the shapes: a scatter's or row-parallel output sliced to T/tp
positions (a new tensor, as a reduce-scatter's is), a gather's input repeated back to T (a new
whole tensor, as an all-gather's is). What autograd saves then has the sizes one rank keeps: a
norm's input T/tp, a gathered matmul input whole. Only the trace's copy of the stage gets them.
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


def emulate_sequence_parallel(part: nn.Module, tp: int) -> None:
    """Hooks on `part`'s modules that give its forward sequence parallel's shapes on one of `tp`
    ranks, and the stage told the split (as apply_tensor_parallel tells it: rotary tables cover
    the whole sequence attention gathers)."""
    plan = tp_plan(part) or {}
    setattr(part, "sequence_shards", tp)  # noqa: B010 (nn.Module types its attributes as tensors or modules)
    for name, module in part.named_modules():
        for pattern, style in plan.items():
            if not fnmatch(name, pattern):
                continue
            if style in _SPLIT_OUTPUT:
                n = _SPLIT_OUTPUT[style]
                module.register_forward_hook(lambda _m, _i, out, n=n: _map(out, n, lambda x: _positions(x, tp)))
            elif style in _GATHER_INPUT:
                n = _GATHER_INPUT[style]
                module.register_forward_pre_hook(lambda _m, args, n=n: _map(args, n, lambda x: _whole(x, tp)))
            elif style == "gather_hidden_states":
                module.register_forward_pre_hook(_gather_keyword(tp), with_kwargs=True)


def _gather_keyword(tp: int) -> Callable:
    """A pre-hook gathering the keyword input `hidden_states` (transformers' attention)."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "hidden_states": _whole(kwargs["hidden_states"], tp)}

    return hook


def _map(value: object, n: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """`fn` applied to a tensor, or to the first `n` floating tensors of a tuple (a mask stays)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    assert isinstance(value, tuple)
    return tuple(
        fn(x) if i < n and isinstance(x, torch.Tensor) and x.is_floating_point() else x for i, x in enumerate(value)
    )


def _positions(x: torch.Tensor, tp: int) -> torch.Tensor:
    """One rank's positions (B, T/tp, ...), in storage of their own (what a reduce-scatter returns)."""
    return x.narrow(1, 0, x.shape[1] // tp).clone()


def _whole(x: torch.Tensor, tp: int) -> torch.Tensor:
    """The whole sequence back (B, T, ...), a new tensor (what an all-gather returns)."""
    return torch.cat([x] * tp, dim=1)
