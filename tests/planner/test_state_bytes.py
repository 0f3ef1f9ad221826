"""One training-state estimate: what `--dry-run` prints per pipeline rank is the planner's number
for the same layout (params, grads and optimizer bytes of the stages built on the meta device)."""

from __future__ import annotations

import re

import pytest

from meshrun.config.schema import Config
from meshrun.models.families import build_model
from meshrun.planner.dry_run import describe_job
from meshrun.planner.layout_memory import layout_memory, rank_state_bytes

TINY = {"model": {"num_layers": 4, "dim": 32, "num_heads": 2, "vocab_size": 256, "seq_len": 16}}


@pytest.mark.parametrize(
    "parallel",
    [
        {"pp": 2},
        {"pp": 2, "dp": 2, "dp_mode": "fsdp"},
        {"pp": 2, "dp": 4, "dp_mode": "hsdp", "dp_shard": 2, "schedule": "interleaved-1f1b"},
        {"pp": 2, "tp": 2},
        {"dp": 2, "dp_mode": "fsdp", "tp": 2},
    ],
)
def test_dry_run_prints_the_planners_state_bytes(parallel: dict) -> None:
    cfg = Config.model_validate({**TINY, "parallel": parallel, "train": {"global_batch": 16, "micro_batch": 1}})
    printed = re.findall(
        r"pipeline rank (\d+): per rank params ([\d.]+) MiB \+ grads ([\d.]+) MiB \+ optimizer ([\d.]+) MiB",
        describe_job(cfg, build_model(cfg.model)),
    )
    planned = layout_memory(cfg, "fp32").ranks
    assert len(printed) == len(planned) == cfg.parallel.pp
    for (rank, *mib), memory in zip(printed, planned):
        expected = [f"{b / 2**20:.2f}" for b in (memory.params, memory.grads, memory.optimizer)]
        assert mib == expected, f"pipeline rank {rank}"
    exact = rank_state_bytes(cfg)
    assert exact is not None
    assert [(m.params, m.grads, m.optimizer) for m in exact] == [(m.params, m.grads, m.optimizer) for m in planned]
    # GPT's tp plan splits every matrix but the position embedding, and the biases of q, k, v and fc
    # (not those of the row-split projections, nor the norms)
    tp = cfg.parallel.tp
    split = ("embed.tok.", "attn.q.", "attn.k.", "attn.v.", "mlp.fc.", "proj.weight", "head.")
    per_rank = sum(
        p.numel() // tp if tp > 1 and any(s in n for s in split) else p.numel()
        for n, p in build_model(cfg.model).named_parameters()
    )
    assert sum(m.params for m in planned) * cfg.layout.dp_shard == pytest.approx(
        per_rank * 4, abs=4 * cfg.layout.dp_shard
    )


def test_a_phi3_tp_stage_is_traced_with_one_ranks_heads() -> None:
    """Phi-3's attention slices its fused q, k, v output by head counts it reads as numbers: the
    planner's trace of a tp rank gives it one rank's share as training does (models' tp_local),
    else the traced matmuls do not fit (the plan crashed)."""
    hf_config = {
        "model_type": "phi3",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
        "pad_token_id": 0,
    }
    cfg = Config.model_validate(
        {
            "model": {"hf_config": hf_config, "seq_len": 16},
            "parallel": {"tp": 2, "pp": 2},
            "train": {"global_batch": 4, "micro_batch": 1},
        }
    )
    planned = layout_memory(cfg, "fp32").ranks
    exact = rank_state_bytes(cfg)
    assert exact is not None
    assert [(m.params, m.grads, m.optimizer) for m in exact] == [(m.params, m.grads, m.optimizer) for m in planned]
    assert all(m.activations > 0 for m in planned)


def test_lora_under_tp_is_planned_as_it_trains() -> None:
    """model.lora over tp2 x pp2: the planner's state is the exact one (gradients and AdamW for the
    adapters only, split as tp splits them: B of a column-parallel layer, A of a row-parallel one),
    and its FLOPs per token summed over stages and tp ranks are the metrics' LoRA count (4 per frozen
    weight, 6 per adapter weight, attention)."""
    from meshrun.models.families import flops_at
    from meshrun.parallel.materialise import build_stage
    from meshrun.planner.search import has_tp_plan
    from meshrun.planner.stage_cost import profile_stages

    hf_config = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
    }
    cfg = Config.model_validate(
        {
            "model": {"hf_config": hf_config, "seq_len": 16, "lora": {"r": 4, "target_modules": "all-linear"}},
            "parallel": {"tp": 2, "pp": 2},
            "train": {"global_batch": 4, "micro_batch": 1},
        }
    )
    assert has_tp_plan(cfg)
    planned = layout_memory(cfg, "fp32").ranks
    exact = rank_state_bytes(cfg)
    assert exact is not None
    assert [(m.params, m.grads, m.optimizer) for m in exact] == [(m.params, m.grads, m.optimizer) for m in planned]
    whole = build_stage(cfg, layers=None, first=True, last=True)
    split = (".q_proj.lora_B", ".k_proj.lora_B", ".v_proj.lora_B", "gate_proj.lora_B", "up_proj.lora_B")
    split += (".o_proj.lora_A", ".down_proj.lora_A")
    adapters = [(n, p.numel()) for n, p in whole.named_parameters() if p.requires_grad]
    assert len(adapters) == 2 * 7 * 2
    per_rank = sum(numel // 2 if any(s in n for s in split) else numel for n, numel in adapters)
    assert sum(m.grads for m in planned) == 4 * per_rank  # fp32, every stage once
    assert sum(m.optimizer for m in planned) == 2 * 4 * per_rank + 4 * len(adapters)  # two moments, a step each
    stages = profile_stages(cfg, [[0], [1]], 1, "fp32")
    assert sum(s.model_flops_per_token for s in stages) * 2 == pytest.approx(flops_at(whole, 16), rel=1e-12)
    full = Config.model_validate({**cfg.model_dump(), "model": {**cfg.model.model_dump(), "lora": None}})
    assert flops_at(whole, 16) < sum(s.model_flops_per_token for s in profile_stages(full, [[0], [1]], 1, "fp32")) * 2
