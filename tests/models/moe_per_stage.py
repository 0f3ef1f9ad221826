"""A deliberately broken MoE GPT for tests (`model.factory: moe_per_stage:build`): each pipeline
stage normalises the balance loss by the MoE layers IT holds instead of the model's, the kind of
per-rank normalisation that makes the loss depend on the layout."""

from __future__ import annotations

from meshrun.config.model_sections import FactorySection, GPTSection
from meshrun.models.moe import MoEGPT, sparse_mlps

SHARED = ("num_layers", "dim", "num_heads", "seq_len", "vocab_size")


class PerStageBalance(MoEGPT):
    def keep_stage(self, *, first: bool, last: bool) -> None:
        if not first:
            self.embed = None
        if not last:
            self.norm = self.head = None
        self.balance.num_moe_layers = len(sparse_mlps(self.blocks))  # the bug: this stage's layers only


def build(cfg: FactorySection) -> PerStageBalance:
    return PerStageBalance(GPTSection(**{key: getattr(cfg, key) for key in SHARED}, moe=cfg.options))
