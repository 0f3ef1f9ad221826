"""The planner's layouts of a config that asks for sequence parallel: planned with it where tp > 1
(its activations traced split by position), without it where tp is 1 (which refuses it)."""

from __future__ import annotations

import pytest
from measure_memory import layout_config

from meshrun.planner.search import candidates, stage_profiles


def test_a_sequence_parallel_config_is_planned_with_it_where_tp_splits() -> None:
    cfg = layout_config(["parallel.tp=2", "parallel.sequence_parallel=true", "train.global_batch=4"])
    layouts = candidates(cfg, 2)
    assert {c.parallel.tp for c in layouts} == {1, 2}
    assert all(c.parallel.sequence_parallel == (c.parallel.tp == 2) for c in layouts)
    split = next(c for c in layouts if c.parallel.tp == 2 and c.parallel.pp == 1 and c.recompute == "none")
    plain = split.model_copy(update={"parallel": split.parallel.model_copy(update={"sequence_parallel": False})})
    assert stage_profiles(split, "fp32")[0].activation_bytes < stage_profiles(plain, "fp32")[0].activation_bytes


def test_packed_rows_are_priced_at_their_attention_length() -> None:
    """Rows of packed documents cost the attention of each document alone: at an attention
    length L below model.seq_len S, every block's FLOPs per token fall by the built-in GPT's
    causal attention term 12 x dim x (S - L) (PaLM appendix B, as its flops_per_token counts it;
    recomputed blocks a third more), the same on every pipeline stage; at S nothing changes."""
    from meshrun.planner.stage_cost import priced_at_length

    cfg = layout_config(["parallel.pp=2", "recompute=full", "train.global_batch=4", "model.seq_len=64"])
    full = stage_profiles(cfg, "fp32")
    assert priced_at_length(cfg, full, 64) == full
    packed = priced_at_length(cfg, full, 24)
    per_block = 12 * cfg.model.dim * (64 - 24)
    for f, p in zip(full, packed, strict=True):
        assert f.blocks == 2 and f.recomputed_blocks == 2
        assert f.model_flops_per_token - p.model_flops_per_token == pytest.approx(per_block * f.blocks, rel=1e-12)
        recomputed = per_block * f.recomputed_blocks / 3
        assert f.recompute_flops_per_token - p.recompute_flops_per_token == pytest.approx(recomputed, rel=1e-12)
