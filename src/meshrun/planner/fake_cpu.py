"""The fake mode the planner traces in, and the fake CPU tensors a traced part holds.

Fake tensors have shapes and CPU kernel choices but no storage. torch has no public fake-tensor
mode (torch.compile and torch's own memory tracker use this one); it is imported only here. One
mode serves every trace (a fake tensor belongs to the mode that made it), so a part's parameters
and buffers are made once per shape and kind and handed to every later trace: `to_empty` would
convert each meta tensor to a fake one (from_real_tensor), then wrap it as a Parameter (a detach),
most of a one-block piece's trace time for a 7B model.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


class FakeCPU:
    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode: FakeTensorMode = FakeTensorMode(allow_non_fake_inputs=True)
        self._made: dict[tuple, list[torch.Tensor]] = {}  # (shape, stride, dtype, requires_grad, parameter) -> tensors

    def to_empty(self, part: nn.Module) -> None:
        """`part.to_empty(device="cpu")`, called inside `self.mode`: each parameter and buffer a fake CPU
        tensor of its shape, strides, dtype and requires_grad. Within one part every tensor is its
        own (a tied matrix, one tensor held twice, stays one), so what a trace counts is unchanged."""
        given: dict[int, torch.Tensor] = {}
        taken: Counter[tuple] = Counter()
        for module in part.modules():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if id(tensor) not in given:
                    key = (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.requires_grad)
                    key += (isinstance(tensor, nn.Parameter),)
                    made = self._made.setdefault(key, [])
                    if taken[key] == len(made):
                        made.append(self._make(key))
                    given[id(tensor)] = made[taken[key]]
                    taken[key] += 1
                setattr(module, name, given[id(tensor)])

    def _make(self, key: tuple) -> torch.Tensor:
        shape, stride, dtype, requires_grad, parameter = key
        empty = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
        return nn.Parameter(empty, requires_grad=requires_grad) if parameter else empty


@functools.cache
def fake_cpu() -> FakeCPU:
    """The one FakeCPU of this process (made at the first trace)."""
    return FakeCPU()
