"""Dropout under tensor parallelism: which random stream each region of a tp stage draws from.

The ranks of a tp group share one dropout stream (training seeds it per tp group), which the
replicated residual stream needs: every tp rank holds the same activations there and must drop the
same ones. Where a rank holds its own part of the activations, the shared stream would repeat one
mask on different data (head h of rank 0 and head h + H/tp of rank 1; under sequence parallel,
position p and p + T/tp). There each rank draws from its own stream (Megatron's model-parallel RNG
tracker), in these regions:

- a module holding a row-parallel Linear (attention, the MLP: its style's record in tp_styles.py
  `closes_rank_stream`), from its entry to that Linear: its interior runs on this rank's heads or
  columns (attention-probability dropout; such a module draws nothing before its column-parallel
  projections, whose input is replicated); the row-parallel output, summed over the ranks, is
  replicated again;
- under sequence parallel, every block: between the scatter and the gather a block holds this
  rank's positions or, inside attention and the MLP, this rank's heads or columns.

At each entry the region draws a seed from the shared CPU stream and seeds the device's default
generator with (seed, tp rank); at its exit the shared state comes back. Nothing of the rank streams
is kept between entries, so the checkpointed RNG state (the shared stream) resumes them exactly,
and recompute reruns the same masks: torch.utils.checkpoint restores the shared states before it
reruns a block, so the rerun draws the same seed. The draw is a host (CPU) op and the device
generator's state is host-side (seed, offset): no device sync. A hook that runs inside a compiled
block's graph (train.compile) steps aside, as dynamo cannot capture a generator swap: masks there
come from the shared stream. The model declares nothing for this: the regions are read from the tp
plan it declares, and the hooks are set here, so it stays free of distributed code.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn

from meshrun.parallel.tp_styles import TP_STYLES


class RankStream:
    """One region's switch to this tp rank's stream of the `generator` (the device's default)."""

    def __init__(self, generator: torch.Generator, *, tp_rank: int, tp: int) -> None:
        self.generator, self.tp_rank, self.tp = generator, tp_rank, tp
        self.shared: torch.Tensor | None = None  # the shared state while inside the region

    def enter(self, *_: object) -> None:
        if torch.compiler.is_compiling():
            return
        # from the shared CPU stream, equal on every tp rank; advances it, so the next region differs
        seed = int(torch.randint(2**62 // self.tp, (), device="cpu"))
        self.shared = self.generator.get_state()
        self.generator.manual_seed(seed * self.tp + self.tp_rank)

    def leave(self, *_: object) -> None:
        """At the region's end, or its module's exit (also on an exception: recompute stops early)."""
        if self.shared is not None:
            self.generator.set_state(self.shared)
            self.shared = None


def rank_stream_regions(
    part: nn.Module, plan: dict[str, str], *, sequence_parallel: bool
) -> list[tuple[nn.Module, nn.Module | None]]:
    """(module, the child where its region ends, None: at its exit) for each region of `part`."""
    if sequence_parallel:
        return [(block, None) for block in part.get_submodule("blocks").children()]
    ends = [
        name
        for name, _ in part.named_modules()
        if "." in name
        and any(TP_STYLES[style].closes_rank_stream and fnmatch(name, pattern) for pattern, style in plan.items())
    ]
    return [(part.get_submodule(name.rsplit(".", 1)[0]), part.get_submodule(name)) for name in ends]


def use_rank_streams(part: nn.Module, plan: dict[str, str], *, tp_rank: int, tp: int, sequence_parallel: bool) -> None:
    """Hook each region of this tp stage (before recompute wraps its blocks: the reruns pass the hooks)."""
    device = next(part.parameters()).device
    generator = _cuda_generator(device) if device.type == "cuda" else torch.default_generator
    for module, end in rank_stream_regions(part, plan, sequence_parallel=sequence_parallel):
        stream = RankStream(generator, tp_rank=tp_rank, tp=tp)
        module.register_forward_pre_hook(stream.enter)
        module.register_forward_hook(stream.leave, always_call=True)
        if end is not None:
            end.register_forward_pre_hook(stream.leave)


def _cuda_generator(device: torch.device) -> torch.Generator:
    return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
