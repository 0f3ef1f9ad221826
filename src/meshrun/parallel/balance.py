"""Stage splits from measurements, with fairscale's balancers.

The model is profiled as a flat sequence [embedding, block 0 .. block L-1, norm + head], so
the first and last stages pay for the parts they carry. Runs on one rank (rank 0), on a
whole copy of the model; the resulting split is broadcast so every rank agrees.
"""

from __future__ import annotations

import torch
from fairscale.nn.pipe.balance import balance_by_size, balance_by_time
from fairscale.nn.pipe.balance.blockpartition import solve
from torch import nn

from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.models.hf_config import num_layers
from meshrun.models.protocol import ProtocolModule, standalone_blocks
from meshrun.models.task_io import task_io
from meshrun.parallel.stages import check_split, sizes_to_split


def _as_sequence(model: ProtocolModule) -> nn.Sequential:
    blocks = standalone_blocks(model)  # blocks that need more than hidden states come wrapped
    assert model.embed is not None and model.norm is not None and model.head is not None  # a whole model
    return nn.Sequential(model.embed, *blocks, nn.Sequential(model.norm, model.head))


def measured_split(cfg: Config, num_stages: int, *, by: str) -> list[list[int]]:
    """Blocks per stage balancing measured forward+backward time, or memory size."""
    from meshrun.hardware.device import pick_device
    from meshrun.parallel.materialise import materialise_part

    device, _ = pick_device()
    model = materialise_part(cfg, device, layers=None, first=True, last=True)
    sequence = _as_sequence(model)
    # a microbatch of what the task's first stage reads (token ids, or a series' values)
    sample = task_io(cfg).inputs.random(cfg.train.micro_batch, torch.Generator().manual_seed(0)).to(device)
    if by == "time":
        sizes = balance_by_time(num_stages, sequence, sample, device=device)
    elif device.type == "cuda":
        sizes = balance_by_size(num_stages, sequence, sample, device=device)
    else:  # fairscale profiles memory on CUDA only: balance parameter counts instead
        costs = [sum(p.numel() for p in layer.parameters()) for layer in sequence]
        sizes = [len(group) for group in solve(costs, num_stages)]
    blocks = [size - (i == 0) - (i == num_stages - 1) for i, size in enumerate(sizes)]
    if min(blocks) < 1:
        raise ConfigError(
            f"parallel.balance={by} left a pipeline stage without blocks (sizes {sizes}); "
            "use parallel.balance=even or parallel.stage_layers"
        )
    return check_split(sizes_to_split(blocks), num_layers(cfg.model), num_stages)
