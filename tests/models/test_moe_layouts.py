"""transformers' Qwen3-MoE from a pretrained folder (each rank loading its stages and its experts only)
under parallel.ep equals one process over 10 clipped AdamW steps: at dp2 x pp2 x ep2 (fsdp; ddp
refuses them) under the two schedules that split the backward, ZBV (two stages a rank, a V) and
zero-bubble, under GPipe and looped BFS (two stages a rank, breadth first), and at dp4 x ep2 under
hsdp (replicate 2 x shard 2). `export --hf` of the ZBV run writes the whole model (every expert,
every layer) that transformers loads with meshrun's logits, and `sample` reads it. bf16 autocast and
fp16 with its GradScaler at dp2 x ep2 track the fp32 run. Five 4-rank launches, two 2-rank ones."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import (
    final_weights,
    grad_norms,
    in_process_trainer,
    losses,
    max_weight_diff,
    meshrun_in_process,
    read_metrics,
    run_meshrun,
    tiny,
)
from test_moe import MOE_FAMILIES, routing

QWEN3_MOE = {**MOE_FAMILIES["qwen3_moe"], "num_hidden_layers": 4}  # a layer per ZBV stage; layer 1 dense
SETTINGS = {"model.seq_len": 16, "train.steps": 10, "train.grad_clip": 0.5}
EP2_PP2 = {"parallel.dp": 2, "parallel.pp": 2, "parallel.ep": 2, "parallel.dp_mode": "fsdp"}
LAYOUTS = {  # zbv, zero-bubble: the first stage's whole backward runs in its W action
    "zbv": {**EP2_PP2, "parallel.schedule": "zbv"},
    "zero-bubble": {**EP2_PP2, "parallel.schedule": "zero-bubble"},
    "gpipe": {**EP2_PP2, "parallel.schedule": "gpipe"},  # every forward, then every backward
    "looped-bfs": {**EP2_PP2, "parallel.schedule": "looped-bfs"},  # a rank's two stages, breadth first
    "hsdp": {"parallel.dp": 4, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 2, "parallel.ep": 2},
}


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The ep runs (launched) and the one-process run (in this process) from the same folder."""
    import transformers

    tmp = tmp_path_factory.mktemp("moe_zbv")
    config = transformers.AutoConfig.for_model("qwen3_moe", **QWEN3_MOE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
    settings = {"model.hf": tmp / "model", **SETTINGS}
    for name, layout in LAYOUTS.items():
        run_meshrun(["train", *tiny(data_dir, tmp / name, **settings, **layout)], tmp_path=tmp, timeout=600)
    with in_process_trainer(data_dir, tmp / "one", **settings) as trainer:
        trainer.train()
    return {name: tmp / name for name in (*LAYOUTS, "one", "model")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layouts_equal_one_process(runs: dict[str, Path], layout: str) -> None:
    """Every step's loss, gradient norm and routing (tokens per expert per layer, the balance loss:
    a split backward's first stage counts too), and the weights after 10 steps, equal one process's (1e-5)."""
    split, one = runs[layout], runs["one"]
    assert len(losses(split)) == 10
    assert losses(split) == pytest.approx(losses(one), rel=1e-5)
    assert grad_norms(split) == pytest.approx(grad_norms(one), rel=1e-5)
    assert routing(split)[0]["aux_loss"] > 0
    assert all(a == pytest.approx(b, rel=1e-5) for a, b in zip(routing(split), routing(one), strict=True))
    assert max_weight_diff(final_weights(split), final_weights(one)) < 1e-5


@pytest.mark.timeout(900)
def test_export_hf_of_an_ep2_pp2_run_loads_in_transformers(runs: dict[str, Path], tmp_path: Path) -> None:
    """The exported folder holds every layer's every expert (one tensor each, as save_pretrained
    writes them) and transformers' model of it gives the logits of meshrun's whole trained model;
    `sample` generates from the run's checkpoint."""
    from hf_models import load_reference
    from safetensors import safe_open

    from meshrun.cli.use_checkpoint import load_full_model

    out = tmp_path / "exported"
    meshrun_in_process(["export", runs["zbv"], "--hf", out], tmp_path=tmp_path)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    sparse = [layer for layer in range(4) if layer != 1]
    assert {f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight" for i in sparse for e in range(4)} <= keys
    ours = load_full_model(runs["zbv"])[0].eval()
    theirs = load_reference(out).eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(input_ids=tokens).logits - ours(tokens)).abs().max().item() < 1e-5
    trained = load_reference(runs["model"]).state_dict()["model.layers.3.mlp.experts.gate_up_proj"]
    assert not torch.equal(theirs.state_dict()["model.layers.3.mlp.experts.gate_up_proj"], trained)  # trained ones
    text = meshrun_in_process(["sample", runs["zbv"], "--prompt", "ab", "--tokens", "5"], tmp_path=tmp_path).stdout
    assert text.startswith("ab")


LOW_PRECISION = {
    p: {"parallel.dp": 2, "parallel.ep": 2, "precision": p, "train.steps": 3, "train.lr": 3e-3}
    for p in ("bf16", "fp16")
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", list(LOW_PRECISION))
def test_low_precision_under_ep_tracks_fp32(precision: str, runs: dict[str, Path], data_dir: Path) -> None:
    """bf16 autocast, and fp16 with its GradScaler, at dp2 x ep2 (the tokens' all-to-alls carry
    half-precision activations) track the fp32 one-process run at step 1: the loss within 2e-5 and
    the pre-clip gradient norm and balance loss within 1e-3, relative; every step finite, the run
    trains on (fp16: its loss scale logged). Tighter than the cp rows' 1%: at this tiny model's init
    the loss sits near log(vocab), so half precision moves it by ~3e-6 (bf16; fp16 2e-6) and the
    norm by 2e-4 (fp16 1e-5), while tokens returned to the wrong rows move them by 7e-5 and 2e-3,
    which 1% would pass (measured on CPU)."""
    run = runs["model"].parent / precision
    settings = {"model.hf": runs["model"], **SETTINGS, **LOW_PRECISION[precision]}
    run_meshrun(["train", *tiny(data_dir, run, **settings)], tmp_path=run.parent, timeout=600)
    ours, one = losses(run), runs["one"]
    assert len(ours) == 3 and all(map(math.isfinite, ours))
    assert ours[0] == pytest.approx(losses(one)[0], rel=2e-5)
    assert grad_norms(run)[0] == pytest.approx(grad_norms(one)[0], rel=1e-3)
    assert routing(run)[0]["aux_loss"] == pytest.approx(routing(one)[0]["aux_loss"], rel=1e-3)
    assert ours[-1] < ours[0]
    assert ("loss_scale" in read_metrics(run)[0]) == (precision == "fp16")  # the GradScaler ran
