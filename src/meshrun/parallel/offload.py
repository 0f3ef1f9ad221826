"""Activation offload (`train.offload_activations`): the tensors a block's backward needs kept in
host memory from its forward until its backward, instead of on the device.

A selected block runs under saved-tensor hooks (torch's mechanism for `save_on_cpu`) that keep each
saved tensor in a host buffer of the same strides (`empty_like`, not torch's contiguous `empty`: a
compiled block's backward checks the strides of what its forward saved), and hand it back when
backward unpacks it. The hooks sit outside the compiled forward, which dynamo does not trace them
in (parallelize.py wraps blocks after compiling them). The wrapper is torch's `ActivationWrapper`,
the base of the checkpoint wrapper recompute uses, whose state-dict hooks keep parameter names
unchanged.

On CUDA the copies leave the compute stream (`save_on_cpu` copies on it: measured 6x the step time
on an H200, bench/README.md): pinned buffers, the copy out on a side stream after the compute
stream's event, the copy back on a second side stream when the block's backward begins, with the
block before it prefetched (torchtitan's and Megatron's pattern; `HostCopies` says how each step is
kept safe). On a CPU the copy is a plain host copy (nothing to pin, no streams): the same values,
so results are bit-identical with offload on or off.

Blocks are chosen by their global layer index, as recompute's are, so the choice is the same
whatever the pipeline split. A block is either recomputed or offloaded: one that the recompute
policy selects keeps nothing to offload, and is left to recompute.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from meshrun.parallel.recompute import wants_recompute


class Streams:
    """One device's side streams for offload: out (device to host) and back (host to device), so a
    prefetch is not queued behind a later microbatch's copies out."""

    def __init__(self) -> None:
        self.out, self.back = torch.cuda.Stream(), torch.cuda.Stream()


class _Copy:
    """One saved CUDA tensor's trip: to a pinned host buffer on the out stream (after the compute
    stream has written it), back on the back stream when its block's backward nears (`fetch`,
    after the copy out), handed to backward on the stream backward runs on (which waits for it).
    Each device tensor is `record_stream`ed to the stream that last uses it, so the caching
    allocator reuses its memory only after that use (torch's documented rule for side streams)."""

    __slots__ = ("__weakref__", "copied_out", "device", "host", "ready", "returned")

    def __init__(self, tensor: torch.Tensor, streams: Streams) -> None:
        out = streams.out
        out.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(out):
            self.host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.copied_out = torch.cuda.Event()
            self.copied_out.record(out)
        tensor.record_stream(out)
        self.device = tensor.device
        self.returned: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def fetch(self, streams: Streams) -> None:
        """Start the copy back, once per use."""
        if self.returned is not None:
            return
        back = streams.back
        back.wait_event(self.copied_out)
        with torch.cuda.stream(back):
            self.returned = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(back)

    def take(self, streams: Streams) -> torch.Tensor:
        """The tensor on the device, for the current stream (a second unpack fetches it again)."""
        self.fetch(streams)
        assert self.returned is not None and self.ready is not None
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.ready)
        tensor, self.returned = self.returned, None
        tensor.record_stream(stream)
        return tensor


class _Group:
    """The copies of one block's forward, fetched together. Held by its unpack hook (so by autograd
    while any of the block's saved tensors lives); it holds its copies weakly, so a copy autograd
    has dropped frees its memory whatever still names the group."""

    def __init__(self, previous: _Group | None) -> None:
        self.copies: list[weakref.ref[_Copy]] = []
        self.previous = previous  # the block before in this forward: the next one backward reaches

    def fetch(self, streams: Streams) -> None:
        for ref in self.copies:
            copy = ref()
            if copy is not None:
                copy.fetch(streams)


class HostCopies(torch.autograd.graph.saved_tensors_hooks):
    """Each tensor autograd saves, kept in host memory with its strides. On a CPU a plain host copy
    (the same values: results bit-identical). On CUDA pinned, copied out on a side stream while the
    forward goes on; when a block's backward unpacks its first tensor, the whole block's copies
    come back, and the block before it (the next backward) is prefetched, so its copies overlap
    this block's backward. Safe because autograd's saved tensors are not written after they are
    saved (an in-place write would fail backward's version check without offload)."""

    def __init__(self, streams: Streams | None, previous: _Group | None) -> None:
        self.group = group = _Group(previous)

        def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor] | _Copy:
            if streams is not None and tensor.is_cuda and not tensor.is_sparse:
                copy = _Copy(tensor, streams)
                group.copies.append(weakref.ref(copy))
                return copy
            host = torch.empty_like(tensor, device="cpu")
            host.copy_(tensor)
            return tensor.device, host

        def unpack(packed: tuple[torch.device, torch.Tensor] | _Copy) -> torch.Tensor:
            if isinstance(packed, _Copy):
                assert streams is not None  # a _Copy is made only with streams
                group.fetch(streams)
                if group.previous is not None:
                    group.previous.fetch(streams)
                return packed.take(streams)
            device, host = packed
            return host.to(device)

        super().__init__(pack, unpack)


class Chain:
    """What a stage's offloaded blocks share: each one's newest forward group by block key (in a
    pipeline the block before runs just before it, in the same microbatch), held weakly, and the
    CUDA side streams (made on first use where CUDA is; None on a CPU)."""

    def __init__(self) -> None:
        self.last: dict[str, weakref.ref[_Group]] = {}
        self._streams: Streams | None = None

    def streams(self) -> Streams | None:
        if self._streams is None and torch.cuda.is_available():
            self._streams = Streams()
        return self._streams

    def previous(self, key: str | None) -> _Group | None:
        ref = self.last.get(key) if key is not None else None
        return ref() if ref is not None else None


class OffloadedBlock(ActivationWrapper):
    """A block whose saved activations wait for its backward in host memory; `before`: the key of
    the offloaded block before it in its stage (whose copies its backward prefetches)."""

    def __init__(self, module: nn.Module, chain: Chain, *, key: str, before: str | None) -> None:
        super().__init__(module)
        self.chain, self.key, self.before = chain, key, before

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hooks = HostCopies(self.chain.streams(), self.chain.previous(self.before))
        with hooks:
            out = self._checkpoint_wrapped_module(*args, **kwargs)
        self.chain.last[self.key] = weakref.ref(hooks.group)
        return out


def wants_offload(policy: bool | str, layer: int) -> bool:
    """Whether `policy` (true, false, every:N) offloads block `layer`'s saved activations."""
    if isinstance(policy, bool):
        return policy
    return wants_recompute(policy, layer)  # every:N selects blocks as recompute's every:N does


def apply_offload(blocks: nn.ModuleDict, policy: bool | str, *, recompute: str) -> None:
    """Wrap the blocks `policy` selects and `recompute` does not with torch's offload wrapper."""
    chain, before = Chain(), None
    for key in list(blocks.keys()):
        if wants_offload(policy, int(key)) and not wants_recompute(recompute, int(key)):
            blocks[key], before = OffloadedBlock(blocks[key], chain, key=key, before=before), key
