"""Tied input embedding and output head across pipeline stages (Megatron's embedding group).

A tied model (GPT-2, Llama/Qwen with tie_word_embeddings) shares one matrix between the
embedding on the first stage and the head on the last. Each of those stages holds a copy under
the same name (`model.tied_weight`). After the backward, the two gradients are summed over a
process group of exactly those two ranks (same dp_rank), or locally when one rank runs both
stages, so both copies take identical optimizer steps and stay bit-identical. The global
gradient norm counts the matrix once (`counted_once`); checkpoints hold it once because both
copies are saved under one name (DCP writes a name once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshrun.errors import RunError
from meshrun.models.protocol import tied_weight
from meshrun.parallel.fsdp import local
from meshrun.parallel.mesh import Mesh


class TiedEmbeddings:
    def __init__(
        self,
        parts: Sequence[nn.Module],
        stages: list[int],
        *,
        num_stages: int,
        mesh: Mesh,
    ) -> None:
        """Collective when the model is tied and pipelined: every rank builds every pair's group."""
        self.copies: list[nn.Parameter] = []  # this rank's copies (0, 1 or 2)
        self.duplicates: list[nn.Parameter] = []  # copies left out of the gradient norm (not on stage 0)
        self.group: dist.ProcessGroup | None = None
        name = tied_weight(parts[0])
        if name is None or num_stages == 1:
            return  # untied, or one stage: the head already uses the embedding's own parameter
        for part, stage in zip(parts, stages):
            if stage in (0, num_stages - 1) and part.get_parameter(name).requires_grad:  # frozen (LoRA): no gradient
                self.copies.append(part.get_parameter(name))
                if stage != 0:
                    self.duplicates.append(self.copies[-1])
        last_pp_rank = mesh.layout.pp_rank_of_stage(num_stages - 1)
        if last_pp_rank == 0:
            return  # one rank runs both stages: summed locally
        for ranks in mesh.layout.across_pp([0, last_pp_rank]):
            group = dist.new_group(ranks)
            if mesh.rank in ranks and self.copies and isinstance(group, dist.ProcessGroup):
                self.group = group  # a member's group (new_group returns a marker to the others)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Sum the embedding and head gradients into both copies (call after backward, before unscale/clip)."""
        if not self.copies:
            return
        # tp and fsdp: both copies' gradients are sharded alike (parallel/tensor.py keeps an embedding's as its shard)
        grads = [local(p.grad) for p in self.copies if p.grad is not None]
        if len(grads) < len(self.copies):
            raise RunError("a copy of the tied embedding got no gradient in the backward; this is a bug")
        total = grads[0] if len(grads) == 1 else grads[0] + grads[1]
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            if grad is not total:
                grad.copy_(total)

    @torch.no_grad()
    def check_identical(self) -> None:
        """Prove the copies are still bit-identical (called before each checkpoint, which saves one)."""
        if not self.copies:
            return
        values = [local(p.detach()) for p in self.copies]
        if self.group is not None:
            low, high = values[0].clone(), values[0].clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
            values += [low, high]
        if not all(torch.equal(values[0], v) for v in values[1:]):
            raise RunError("the tied embedding's copies on the first and last pipeline stage differ; this is a bug")

    def counted_once(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """`params` without the duplicate copies: what the global gradient norm sums over."""
        return [p for p in params if not any(p is d for d in self.duplicates)]
