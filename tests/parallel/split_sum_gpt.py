"""A GPT whose row-parallel Linears (the tp plan's `rowwise`: attn.proj, mlp.proj) compute in one
process what tp2 computes: the input's two feature halves through the weight's two column halves,
each adding half the bias (DTensor's addmm turns RowwiseParallel's replicated bias into a partial
one by halving it), then summed, as the all-reduce sums them. Mathematically the plain GPT, same
parameter names and init; only fp32's summation order is tp2's. Used through
`model.factory: split_sum_gpt:build`."""

from __future__ import annotations

from fnmatch import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT


class SplitSumLinear(nn.Linear):
    """x @ W.T + b as (x0 @ W0.T + b/2) + (x1 @ W1.T + b/2): tp2's local addmm on each rank, then the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = self.in_features // 2
        bias = None if self.bias is None else self.bias / 2
        first = F.linear(x[..., :half].contiguous(), self.weight[:, :half], bias)
        return first + F.linear(x[..., half:].contiguous(), self.weight[:, half:], bias)


def build(cfg: ModelConfig) -> GPT:
    """The plain GPT with every module its tp plan splits `rowwise` computed split-sum."""
    model = GPT(cfg)
    rowwise = [pattern for pattern, style in model.tp_plan().items() if style == "rowwise"]
    for name, module in list(model.named_modules()):
        if any(fnmatch(name, pattern) for pattern in rowwise):
            assert isinstance(module, nn.Linear) and module.bias is not None
            model.set_submodule(name, SplitSumLinear(module.in_features, module.out_features))
    return model
