"""The planner's layouts of a config that asks for sequence parallel: planned with it where tp > 1
(its activations traced split by position), without it where tp is 1 (which refuses it)."""

from __future__ import annotations

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
