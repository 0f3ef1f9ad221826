"""What one pipeline stage costs: exact state bytes, traced activation bytes, FLOPs.

State bytes come from the real model built on the meta device (the same `build_stage` the
trainer uses), so they are exact: fp32 parameters, fp32 gradients, and fused AdamW's two fp32
moments plus one fp32 step counter per parameter tensor. Activation bytes are what one
microbatch keeps for backward: one forward (and the loss, on the last stage) traced under fake
tensors on the CPU (shapes and kernel choices only, no memory), counted by `SavedBytes`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from meshrun.config.schema import Config
from meshrun.hardware.precision import DTYPES
from meshrun.models.protocol import ProtocolModule
from meshrun.parallel.materialise import build_stage
from meshrun.parallel.recompute import apply_recompute, wants_recompute
from meshrun.parallel.tensor import shard_numels
from meshrun.planner.saved_bytes import SavedBytes
from meshrun.training.loss import MicrobatchLoss

_STEP_COUNTER_BYTES = 4  # AdamW's per-tensor `step` (a float32 scalar)


@dataclass(frozen=True)
class StageProfile:
    """One pipeline stage (the whole model when pp = 1) at one micro_batch and recompute policy."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # kept for backward per microbatch
    flops_per_token: float  # training FLOPs (forward + backward, recompute's extra forward included)
    model_flops_per_token: float  # the same without recompute: the useful work MFU counts
    boundary_bytes: int  # the hidden state this stage sends to the next one, per microbatch
    units: int = 1  # blocks + 1 for the embedding (first stage) + 1 for the head (last): what fixed costs scale with

    @property
    def recompute_flops_per_token(self) -> float:
        """The extra forward that recompute runs."""
        return self.flops_per_token - self.model_flops_per_token

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def state_bytes(part: nn.Module, tp: int = 1) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes of a stage on one rank, exactly as training
    allocates them: each tensor the model's tp plan splits counted as its largest shard."""
    numels = shard_numels(part, tp)
    params = list(part.named_parameters())
    trainable = [(n, p) for n, p in params if p.requires_grad]
    param_bytes = sum(numels[n] * p.element_size() for n, p in params)
    grad_bytes = sum(numels[n] * p.element_size() for n, p in trainable)
    return param_bytes, grad_bytes, 2 * grad_bytes + _STEP_COUNTER_BYTES * len(trainable)


def _fake_mode() -> contextlib.AbstractContextManager:
    """Tensors with shapes and CPU kernel choices but no storage. torch has no public fake-tensor
    mode (torch.compile and torch's own memory tracker use this one); it is imported only here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _amp(precision: str) -> contextlib.AbstractContextManager:
    dtype = DTYPES.get(precision, torch.float32)  # auto was resolved before; fp32 runs without autocast
    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def stage_flops_per_token(cfg: Config, part: ProtocolModule, whole: ProtocolModule) -> tuple[float, float]:
    """The whole model's `flops_per_token()` shared out: 6 FLOPs per matmul parameter to the stage
    that holds it (embeddings are lookups: none), the rest (attention) evenly over blocks;
    recomputed blocks add their forward again (a third of their training FLOPs)."""

    def matmul_params(module: ProtocolModule) -> int:
        embed = {id(p) for p in module.embed.parameters()} if module.embed is not None else set()
        return sum(p.numel() for p in module.parameters() if id(p) not in embed)

    total, layers = whole.flops_per_token(), len(whole.blocks)
    attention_per_block = max(0.0, total - 6.0 * matmul_params(whole)) / layers
    useful = 6.0 * matmul_params(part) + attention_per_block * len(part.blocks)
    extra = sum(
        (6.0 * sum(p.numel() for p in block.parameters()) + attention_per_block) / 3
        for key, block in part.blocks.items()
        if wants_recompute(cfg.recompute, int(key))
    )
    return useful + extra, useful


def profile_stages(cfg: Config, split: list[list[int]], micro_batch: int, precision: str) -> list[StageProfile]:
    """Every stage of `split` (blocks per stage, pipeline order) for one microbatch of `micro_batch`."""
    whole = build_stage(cfg, layers=None, first=True, last=True)
    num_stages = len(split)
    parts = [
        build_stage(cfg, layers=layers if num_stages > 1 else None, first=i == 0, last=i == num_stages - 1)
        for i, layers in enumerate(split)
    ]  # on meta, outside the fake mode (it converts them)
    profiles = []
    with _fake_mode():
        x: torch.Tensor = torch.zeros(micro_batch, cfg.model.seq_len, dtype=torch.long)
        targets = torch.zeros(micro_batch, cfg.model.seq_len, dtype=torch.long)
        for index, part in enumerate(parts):
            last = index == num_stages - 1
            flops, useful = stage_flops_per_token(cfg, part, whole)
            part.to_empty(device="cpu")
            apply_recompute(part.blocks, cfg.recompute)
            counter = SavedBytes(exclude=list(part.parameters()))
            counter.count_checkpoint_inputs(part)
            with counter.hooks(), _amp(precision):
                out = part(x)
                loss = MicrobatchLoss(1)(out, targets) if last else None  # its saved log-softmax counts
            profiles.append(
                StageProfile(
                    *state_bytes(part, cfg.parallel.tp),
                    activation_bytes=counter.live,
                    flops_per_token=flops,
                    model_flops_per_token=useful,
                    boundary_bytes=0 if last else out.numel() * out.element_size(),
                    units=len(part.blocks) + (index == 0) + last,
                )
            )
            x = out.detach().requires_grad_(True)
            del out, loss
    return profiles
