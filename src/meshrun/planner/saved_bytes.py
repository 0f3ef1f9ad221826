"""Bytes autograd keeps for backward, counted with saved-tensor hooks: the planner's activation
measure (traced under fake tensors to predict, in real steps to check) and bench/pipeline.py's.

`pack` wraps each saved tensor in a `_Held` that adds its storage's bytes to a live counter;
`_Held.__del__` (run when autograd frees the saved variable after backward) subtracts them.
Each storage counts once however many views of it are saved (q, k, v are views of one qkv
output), and parameter storages are left out (a matmul saves its weight: not an activation).
Storages are told apart by identity (torch keeps one Python object per storage), which works
for fake tensors too, where there is no data pointer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
)
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (tp's saved parameters and replicated
    activations are DTensors; their storage is the shard's), read without recording a graph."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


class SavedBytes:
    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = [local(t).untyped_storage() for t in exclude]  # kept alive, so their ids stay theirs
        self.skip = {id(storage) for storage in self.excluded}
        self.refs: dict[int, int] = {}  # id(storage) -> number of live holders
        self.live = 0
        self.peak = 0
        self.active = True  # pack counts only while active (e.g. only inside Transformer blocks)
        self.cached: list[_Held] = []  # a selective block's kept op outputs, until its forward ends

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self.pack, _unpack)

    def pack(self, tensor: torch.Tensor) -> _Held:
        return _Held(self, tensor, counted=self.active)

    def hold(self, tensor: torch.Tensor) -> _Held:
        """Count a tensor kept alive outside autograd's saved tensors (e.g. a checkpoint's input)."""
        return _Held(self, tensor, counted=True)

    def hold_cached(self, out: object) -> None:
        """Count what selective checkpointing caches (apply_recompute's `on_saved`): an op's outputs."""
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        self.cached += [self.hold(t) for t in outputs if isinstance(t, torch.Tensor)]

    def count_checkpoint_inputs(self, module: torch.nn.Module) -> None:
        """Count each checkpointed block's input, and the outputs a selective policy cached in
        it (`hold_cached`), for as long as its graph lives.

        Non-reentrant torch.utils.checkpoint keeps the input in its recompute closure, outside
        autograd's saved tensors: the holders ride on the block output's graph node (public
        `Node.metadata`) and are dropped when backward reaches that node.
        """
        for block in module.modules():
            if isinstance(block, CheckpointWrapper):
                block.register_forward_hook(self._hold_input)

    def _hold_input(self, block: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        node = output.grad_fn if isinstance(output, torch.Tensor) else None
        if node is None:
            return
        # torch's stub declares Node.metadata a method; at run time it is the node's dict
        held = [self.hold(t) for t in inputs if isinstance(t, torch.Tensor)] + self.cached
        self.cached = []
        node.metadata["meshrun_checkpoint_input"] = held  # pyright: ignore[reportIndexIssue]
        node.register_hook(lambda *_: node.metadata.pop("meshrun_checkpoint_input", None) and None)  # pyright: ignore[reportAttributeAccessIssue]

    def reset_peak(self) -> None:
        self.peak = self.live

    def _add(self, key: int, nbytes: int) -> bool:
        if key in self.skip or nbytes == 0:
            return False
        self.refs[key] = self.refs.get(key, 0) + 1
        if self.refs[key] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return True

    def _remove(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes


class _Held:
    __slots__ = ("counted", "counter", "key", "nbytes", "storage", "tensor")

    def __init__(self, counter: SavedBytes, tensor: torch.Tensor, *, counted: bool) -> None:
        self.storage = local(tensor).untyped_storage()  # held: its id stays this storage's while counted
        self.tensor, self.counter = tensor, counter
        self.key, self.nbytes = id(self.storage), self.storage.nbytes()
        self.counted = counted and counter._add(self.key, self.nbytes)

    def __del__(self) -> None:
        if self.counted:
            self.counter._remove(self.key, self.nbytes)


def _unpack(held: _Held) -> torch.Tensor:
    return held.tensor
