"""`meshrun train` with parallel.ep on the built-in MoE gpt equals one process: dp2 x ep2 under DDP,
dp2 (fsdp) x pp2 x ep2 with recompute, and that run's step-2 checkpoint resumed as one process
(ep2 x pp2 -> ep1 x pp1): losses, gradient norms and final weights (fp32, 4 clipped AdamW steps)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import final_weights, grad_norms, losses, max_weight_diff, run_meshrun, tiny

MOE = {"model.moe.num_experts": 4, "model.num_layers": 2, "checkpoint.interval": 2, "train.grad_clip": 0.5}
LAYOUTS = {
    "one": {},
    "ddp_ep2": {"parallel.dp": 2, "parallel.ep": 2},
    "fsdp_pp2_ep2": {
        "parallel.dp": 2,
        "parallel.ep": 2,
        "parallel.dp_mode": "fsdp",
        "parallel.pp": 2,
        "recompute": "full",
    },
}


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ep")
    for name, layout in LAYOUTS.items():
        run_meshrun(["train", *tiny(data_dir, tmp / name, **MOE, **layout)], tmp_path=tmp, timeout=300)
    resumed = tmp / "resumed"  # the fsdp x pp2 x ep2 run as it stood at step 2, then one process
    shutil.copytree(tmp / "fsdp_pp2_ep2", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    (resumed / "checkpoints" / "latest").write_text("step-00000002\n")
    (resumed / "summary.json").unlink()
    done = run_meshrun(["train", *tiny(data_dir, resumed, **MOE)], tmp_path=tmp, timeout=300)
    assert "resumed from" in done.stderr
    return {**{name: tmp / name for name in LAYOUTS}, "resumed": resumed}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["ddp_ep2", "fsdp_pp2_ep2", "resumed"])
def test_expert_parallel_training_equals_one_process(runs: dict[str, Path], name: str) -> None:
    reference = runs["one"]
    assert losses(runs[name]) == pytest.approx(losses(reference), rel=1e-5)
    assert grad_norms(runs[name]) == pytest.approx(grad_norms(reference), rel=1e-5)
    assert max_weight_diff(final_weights(runs[name]), final_weights(reference)) < 1e-5
