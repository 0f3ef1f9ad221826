"""Bytes autograd keeps for backward, counted with saved-tensor hooks (used by bench/pipeline.py).

`pack` wraps each saved tensor in a `_Held` that adds its storage's bytes to a live counter;
`_Held.__del__` (run when autograd frees the saved variable after backward) subtracts them.
Each storage counts once however many views of it are saved (q, k, v are views of one qkv
output), and parameter storages are left out (a matmul saves its weight: not an activation).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks


class SavedBytes:
    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: dict[int, int] = {}  # storage address -> number of live holders
        self.live = 0
        self.peak = 0
        self.active = True  # pack counts only while active (e.g. only inside Transformer blocks)

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self.pack, _unpack)

    def pack(self, tensor: torch.Tensor) -> "_Held":
        return _Held(self, tensor, counted=self.active)

    def hold(self, tensor: torch.Tensor) -> "_Held":
        """Count a tensor kept alive outside autograd's saved tensors (e.g. a checkpoint's input)."""
        return _Held(self, tensor, counted=True)

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
    __slots__ = ("tensor", "counter", "key", "nbytes", "counted")

    def __init__(self, counter: SavedBytes, tensor: torch.Tensor, *, counted: bool) -> None:
        storage = tensor.untyped_storage()
        self.tensor, self.counter = tensor, counter
        self.key, self.nbytes = storage.data_ptr(), storage.nbytes()
        self.counted = counted and counter._add(self.key, self.nbytes)

    def __del__(self) -> None:
        if self.counted:
            self.counter._remove(self.key, self.nbytes)


def _unpack(held: _Held) -> torch.Tensor:
    return held.tensor
