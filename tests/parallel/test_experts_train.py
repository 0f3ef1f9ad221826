"""`meshrun train` with parallel.ep equals one process over 10 clipped AdamW steps (fp32): losses,
gradient norms, routing (tokens per expert, the balance loss) and final weights. Rows: transformers'
Qwen3-MoE at dp2 x ep2 under DDP and at dp2 x tp2 (sequence parallel) x ep2; the built-in MoE gpt at
dp2 x pp2 x ep2 (fsdp, 1F1B, recompute; ep_dp 1: experts all-reduced), at dp2 x tp2 x ep2 (ddp: FSDP2
keeps the dense replicas, the MoE blocks whole on each tp rank) and dp2 x tp2 (sequence parallel) x
ep2 (fsdp), at dp2 x tp2 (sequence parallel) x ep4 (ddp: ep spanning tp, each tp rank routing its
own positions) and, in the one 8-rank launch, dp4 x pp2 x ep2 (fsdp, interleaved 1F1B: experts sharded
over ep_dp 2); step-5 checkpoints resumed as one process (ep2 x pp2 -> ep1 x pp1, tp2 x ep2 -> 1)
and at dp4 (ep1, ddp)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import final_weights, grad_norms, losses, max_weight_diff, read_metrics, run_meshrun, tiny

STEPS, SAVED = 10, 5
COMMON = {"checkpoint.interval": SAVED, "train.steps": STEPS, "train.grad_clip": 0.5}  # clipped: the split norm counts
BUILT_IN = {"model.moe.num_experts": 4}
QWEN3_MOE = {  # transformers' tiny Qwen3-MoE: 4 experts, top 2, both layers sparse
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256, "num_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
EP2 = {"parallel.dp": 2, "parallel.ep": 2}
PP2_FSDP = {"parallel.pp": 2, "parallel.dp_mode": "fsdp"}
DP4 = {"parallel.dp": 4, "train.micro_batch": 1}  # 2 microbatches a rank: the pipeline's least
TP2_SP = {"parallel.tp": 2, "parallel.sequence_parallel": True}  # the MoE blocks gather the whole sequence
LAYOUTS = {
    "one": BUILT_IN,
    "pp2_ep2": {**BUILT_IN, **EP2, **PP2_FSDP, "recompute": "full"},
    "dp4_pp2_ep2": {**BUILT_IN, **DP4, **PP2_FSDP, "parallel.ep": 2, "parallel.schedule": "interleaved-1f1b"},
    "tp2_ep2": {**BUILT_IN, **EP2, "parallel.tp": 2},
    "tp2_sp_ep2": {**BUILT_IN, **EP2, **TP2_SP, "parallel.dp_mode": "fsdp"},
    "tp2_sp_ep4": {**BUILT_IN, **TP2_SP, "parallel.dp": 2, "parallel.ep": 4},  # each tp rank a share of the experts
    "hf_one": {},
    "hf_ddp_ep2": EP2,
    "hf_tp2_sp_ep2": {**EP2, **TP2_SP},
}
RESUMED = {
    "resumed_one": ("pp2_ep2", BUILT_IN),
    "resumed_dp4": ("dp4_pp2_ep2", {**BUILT_IN, **DP4}),
    "resumed_tp_one": ("tp2_ep2", BUILT_IN),
}
ROWS = ["hf_ddp_ep2", "hf_tp2_sp_ep2", "pp2_ep2", "dp4_pp2_ep2", "tp2_ep2", "tp2_sp_ep2", "tp2_sp_ep4", *RESUMED]


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers

    tmp = tmp_path_factory.mktemp("ep")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **QWEN3_MOE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "qwen3_moe")
    for name, settings in LAYOUTS.items():
        model = {"model.hf": tmp / "qwen3_moe"} if name.startswith("hf") else {}
        run_meshrun(["train", *tiny(data_dir, tmp / name, **COMMON, **model, **settings)], tmp_path=tmp, timeout=600)
    for name, (source, settings) in RESUMED.items():  # the run as it stood at step 5, resumed in another layout
        shutil.copytree(tmp / source, tmp / name)
        shutil.rmtree(tmp / name / "checkpoints" / f"step-{STEPS:08d}")
        (tmp / name / "checkpoints" / "latest").write_text(f"step-{SAVED:08d}\n")
        (tmp / name / "summary.json").unlink()
        done = run_meshrun(["train", *tiny(data_dir, tmp / name, **COMMON, **settings)], tmp_path=tmp, timeout=300)
        assert "resumed from" in done.stderr
    return {name: tmp / name for name in (*LAYOUTS, *RESUMED)}


def routing(run_dir: Path) -> list[dict[str, float]]:
    """Each step's routing figures: tokens per expert (min, max, cv per MoE layer) and the balance loss."""
    rows = [{k: v for k, v in row.items() if k.startswith("moe/") or k == "aux_loss"} for row in read_metrics(run_dir)]
    return [row for row in rows if row]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ROWS)
def test_expert_parallel_training_equals_one_process(runs: dict[str, Path], name: str) -> None:
    """Every step (a resumed run's metrics hold its source's steps to 5, then its own)."""
    reference = runs["hf_one" if name.startswith("hf") else "one"]
    assert len(losses(runs[name])) == STEPS
    assert losses(runs[name]) == pytest.approx(losses(reference), rel=1e-5)
    assert grad_norms(runs[name]) == pytest.approx(grad_norms(reference), rel=1e-5)
    routed, expected = routing(runs[name]), routing(reference)
    assert len(routed) == STEPS and all(row == pytest.approx(want, rel=1e-5) for row, want in zip(routed, expected))
    assert max_weight_diff(final_weights(runs[name]), final_weights(reference)) < 1e-5


def chosen_experts(run_dir: Path) -> torch.Tensor:
    """Every MoE layer's top-k experts, sorted, for each token of a fixed batch, by the run's final
    weights as one whole model: [layers, tokens, k]."""
    from meshrun.cli.use_checkpoint import load_full_model
    from meshrun.models.moe import sparse_mlps

    model = load_full_model(run_dir)[0].eval()
    kept: list[torch.Tensor] = []
    for mlp in sparse_mlps(model.blocks).values():  # ours and transformers' routers return the experts last
        mlp.gate.register_forward_hook(lambda _m, _args, out: kept.append(out[-1].sort(-1).values))
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    return torch.stack(kept)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ROWS)
def test_the_same_tokens_reach_the_same_experts(runs: dict[str, Path], name: str) -> None:
    """Token by token: after 10 steps in each layout, every token of a fixed batch chooses the experts
    it chooses in the one-process run's model (during the split forward itself, tests/parallel/test_experts.py)."""
    reference = runs["hf_one" if name.startswith("hf") else "one"]
    assert torch.equal(chosen_experts(runs[name]), chosen_experts(reference))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["tp2_ep2", "hf_tp2_sp_ep2", "tp2_sp_ep4"])
def test_planned_state_under_tp_equals_the_measured(runs: dict[str, Path], name: str) -> None:
    """--dry-run's and `meshrun plan`'s state per rank (planner/layout_memory.rank_state_bytes: the MoE
    blocks whole on each tp rank, their experts split over ep, a quarter of them where ep 4 spans tp) is the largest rank's measured params,
    gradients and optimizer state after its first step (ddp rows: under fsdp the plan divides AdamW's
    4-byte step counts by the shard degree too, planner/memory.py)."""
    from meshrun.config.schema import Config
    from meshrun.planner.layout_memory import rank_state_bytes

    cfg = Config.model_validate_json((runs[name] / "config.json").read_text())
    (planned,) = rank_state_bytes(cfg) or []
    assert planned.params + planned.grads + planned.optimizer == read_metrics(runs[name])[0]["state_bytes"]
