"""What the planner knows of one pipeline stage: the record every cost and memory term reads
(torch-free: a leaf the planner's modules share)."""

from __future__ import annotations

from dataclasses import dataclass


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
    blocks: int = 0
    recomputed_blocks: int = 0
    moe_blocks: int = 0  # blocks with a MoE MLP: whole on every tp rank, no tp collective of their own
    recomputed_moe_blocks: int = 0
    hidden_bytes: int = 0  # one block's whole output per microbatch (all positions): what a tp all-reduce moves
    backward_bytes: int = 0  # what backward allocates at once beyond the kept activations (the loss's gradient)
    # computed again by every tp rank, not useful work: a MoE block's MLP whole on each (ep within dp)
    replicated_flops_per_token: float = 0.0

    @property
    def recompute_flops_per_token(self) -> float:
        """The extra forward that recompute runs."""
        return self.flops_per_token - self.model_flops_per_token

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes
