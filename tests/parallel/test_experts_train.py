"""`meshrun train` with parallel.ep equals one process: transformers' Qwen3-MoE at dp2 x ep2 under
DDP; the built-in MoE gpt at dp2 (fsdp) x pp2 x ep2 with recompute, and that run's step-2
checkpoint resumed as one process (ep2 x pp2 -> ep1 x pp1): losses, gradient norms and final
weights (fp32, 4 clipped AdamW steps)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import final_weights, grad_norms, losses, max_weight_diff, run_meshrun, tiny

COMMON = {"checkpoint.interval": 2, "train.grad_clip": 0.5}  # clipped: the norm over split experts counts
BUILT_IN = {"model.moe.num_experts": 4, "model.num_layers": 2}
QWEN3_MOE = {  # transformers' tiny Qwen3-MoE: 4 experts, top 2, both layers sparse
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256, "num_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
EP2 = {"parallel.dp": 2, "parallel.ep": 2}
LAYOUTS = {
    "one": BUILT_IN,
    "fsdp_pp2_ep2": {**BUILT_IN, **EP2, "parallel.dp_mode": "fsdp", "parallel.pp": 2, "recompute": "full"},
    "hf_one": {},
    "hf_ddp_ep2": EP2,
}


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers

    tmp = tmp_path_factory.mktemp("ep")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **QWEN3_MOE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "qwen3_moe")
    for name, settings in LAYOUTS.items():
        model = {"model.hf": tmp / "qwen3_moe"} if name.startswith("hf") else {}
        run_meshrun(["train", *tiny(data_dir, tmp / name, **COMMON, **model, **settings)], tmp_path=tmp, timeout=300)
    resumed = tmp / "resumed"  # the fsdp x pp2 x ep2 run as it stood at step 2, then one process
    shutil.copytree(tmp / "fsdp_pp2_ep2", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    (resumed / "checkpoints" / "latest").write_text("step-00000002\n")
    (resumed / "summary.json").unlink()
    done = run_meshrun(["train", *tiny(data_dir, resumed, **COMMON, **BUILT_IN)], tmp_path=tmp, timeout=300)
    assert "resumed from" in done.stderr
    return {**{name: tmp / name for name in LAYOUTS}, "resumed": resumed}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["hf_ddp_ep2", "fsdp_pp2_ep2", "resumed"])
def test_expert_parallel_training_equals_one_process(runs: dict[str, Path], name: str) -> None:
    reference = runs["hf_one" if name.startswith("hf") else "one"]
    assert losses(runs[name]) == pytest.approx(losses(reference), rel=1e-5)
    assert grad_norms(runs[name]) == pytest.approx(grad_norms(reference), rel=1e-5)
    assert max_weight_diff(final_weights(runs[name]), final_weights(reference)) < 1e-5
