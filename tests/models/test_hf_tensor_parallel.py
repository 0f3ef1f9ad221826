"""Hugging Face decoders under tensor parallelism (models/hf.py's tp_plan), fp32, gloo, real
torchrun: step 1 equals transformers itself, and a tp2 run exports full tensors.

The Llama (tests/models/hf_models.py) has 4 query and 2 kv heads, so tp2 holds one kv head per
rank (grouped-query attention with local head counts). OLMo 2 normalises q and k over the whole
projected width: its tp2 x pp2 row (sequence parallel too) proves the gathered norms; its head is tied, so the
vocabulary-split embedding matrix also serves a head on the other pipeline stage. Qwen3's norms
run per head on this rank's heads. Qwen2's q, k and v carry biases (split with their
columns); Mistral is Llama-shaped with its own attention module. Phi-3 fuses q, k, v and gate, up
into one Linear each, which transformers' forward slices by head counts: meshrun holds them as
their parts (a column split of each), and its files and exports hold transformers' fused tensors.
Under sequence parallel the RMSNorms run on a rank's positions while attention (called by keyword)
gathers the whole sequence, whose rotary embeddings the stage computes for all positions; the tp2 x
pp2 rows (Llama, OLMo 2, Phi-3) pass a rank's positions between stages. The refusals (GPT-2's fused Conv1D, kv heads)
live in tests/test_config.py's table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    final_weights,
    losses,
    max_weight_diff,
    meshrun_in_process,
    read_metrics,
    tiny,
    train_job,
)
from hf_models import CONFIGS, SEQ_LEN, load_reference, make_model, reference_loss_and_grad_norm
from test_checkpoint import interrupted_copy

BASE = {"model.seq_len": SEQ_LEN, "train.global_batch": 8, "train.steps": 3, "train.lr": 3e-3, "train.grad_clip": 0.5}
FAMILIES = {  # beside hf_models.py's llama (8 layers; 4 query heads, 2 kv heads)
    "olmo2": {  # whole-width q/k norms, tied head; 4 layers: two per pipeline stage
        **CONFIGS["llama"],
        "model_type": "olmo2",
        "num_hidden_layers": 4,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "qwen3": {**CONFIGS["llama"], "model_type": "qwen3", "num_hidden_layers": 2, "head_dim": 8},  # per-head q/k norms
    "qwen2": {**CONFIGS["llama"], "model_type": "qwen2", "num_hidden_layers": 2},  # q, k, v with biases
    "mistral": {**CONFIGS["llama"], "model_type": "mistral", "num_hidden_layers": 2},
    "phi3": {  # fused qkv_proj (4 query, 2 kv heads of 8) and gate_up_proj; rotary on half of each head
        **CONFIGS["llama"],
        "model_type": "phi3",
        "num_hidden_layers": 2,
        "partial_rotary_factor": 0.5,
        "pad_token_id": 0,
    },
}
ROWS = {
    "llama-tp2": ("llama", {"parallel.tp": 2}),
    # sequence parallel on the way: the whole-width q/k norms gather the heads whether the norms
    # before them hold a rank's positions or all of them
    "olmo2-tp2-sp-pp2": (
        "olmo2",
        {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.pp": 2, "parallel.schedule": "1f1b"},
    ),
    "olmo2-one-process": ("olmo2", {}),
    "qwen3-tp2": ("qwen3", {"parallel.tp": 2}),
    "qwen3-one-process": ("qwen3", {}),
    "qwen2-tp2": ("qwen2", {"parallel.tp": 2}),
    "mistral-tp2": ("mistral", {"parallel.tp": 2}),
    "phi3-tp2": ("phi3", {"parallel.tp": 2, "checkpoint.interval": 2}),  # step 2's checkpoint resumes at tp1
    "phi3-tp2-sp-pp2": (
        "phi3",
        {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.pp": 2, "parallel.schedule": "1f1b"},
    ),
    "phi3-one-process": ("phi3", {}),
    # sequence parallel: RMSNorms on a rank's 8 of 16 positions, attention and MLP gather all 16
    "llama-tp2-sp": ("llama", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "llama-tp2-sp-pp2": ("llama", {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.pp": 2}),
}


def _save(family: str, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(FAMILIES[family])
    torch.manual_seed(0)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-tp")
    return {"llama": make_model("llama", root / "llama", shard=True)} | {f: _save(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def runs(models, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`runs(row)`: that row's finished run, trained the first time a test asks for it."""
    root, done = tmp_path_factory.mktemp("hf-tp-runs"), {}

    def get(row: str) -> Path:
        if row not in done:
            family, layout = ROWS[row]
            train_job(
                tiny(data_dir, root / row, **{**BASE, "model.hf": models[family], **layout}), tmp_path=root, timeout=420
            )
            done[row] = root / row
        return done[row]

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "row",
    [
        "llama-tp2",
        "olmo2-tp2-sp-pp2",
        "qwen2-tp2",
        "mistral-tp2",
        "phi3-tp2",
        "phi3-tp2-sp-pp2",
        "llama-tp2-sp",
        "llama-tp2-sp-pp2",
    ],
)
def test_first_step_equals_transformers(row: str, runs, models, data_dir: Path) -> None:
    """Pretrained weights split over tp ranks: step 1's loss and pre-clip gradient norm are plain
    transformers' (1e-5 relative); a shard counted twice or a replicated norm counted tp times
    moves the norm."""
    from meshrun.data.dataset import TokenDataset

    x, y = TokenDataset(data_dir, "train", seq_len=SEQ_LEN, seed=1337).batch(0, 8)
    loss, grad_norm = reference_loss_and_grad_norm(models[ROWS[row][0]], x, y, num_microbatches=4)
    first = read_metrics(runs(row))[0]
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert first["grad_norm"] > 0.5, "clipping must be active for the step to move weights"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("row", "against"),
    [
        ("olmo2-tp2-sp-pp2", "olmo2-one-process"),
        ("qwen3-tp2", "qwen3-one-process"),
        ("phi3-tp2", "phi3-one-process"),
        ("llama-tp2-sp", "llama-tp2"),
    ],
)
def test_replicated_norms_train_as_one_process(row: str, against: str, runs) -> None:
    """A module left whole (a norm) on every tp rank must get the whole gradient: Qwen3's per-head
    norms see only this rank's heads, whose weight gradient is a sum over all heads (measured:
    left unsummed they end 1.2e-2 away after 2 steps, while step 1's grad norm still agrees to
    1e-6, since those gradients are ~1e-3 of it); under sequence parallel every RMSNorm sees only
    this rank's positions, its gradient a sum over all positions. Weights after 3 clipped AdamW
    steps (measured within 5e-7; Phi-3, whose parts the plan splits, 8.7e-7)."""
    assert max_weight_diff(final_weights(runs(row)), final_weights(runs(against))) < 1e-5


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "row,tensor,shape",
    [
        ("llama-tp2", "model.layers.0.self_attn.k_proj.weight", (16, 32)),  # both kv heads of 8
        ("phi3-tp2", "model.layers.0.self_attn.qkv_proj.weight", (64, 32)),  # 4 q + 2 k + 2 v heads of 8
    ],
)
def test_export_from_tp2_loads_in_transformers(row: str, tensor: str, shape: tuple, runs, tmp_path: Path) -> None:
    """export --hf of a tp2 checkpoint writes whole tensors (Phi-3's parts joined back into
    transformers' fused ones): transformers computes the trained model's logits, as meshrun's
    one-process load of the same checkpoint does."""
    from meshrun.cli.use_checkpoint import load_full_model

    run, out = runs(row), tmp_path / "exported"
    meshrun_in_process(["export", run, "--hf", out], tmp_path=tmp_path)
    theirs, ours = load_reference(out).eval(), load_full_model(run)[0]
    assert theirs.get_parameter(tensor).shape == shape
    tokens = torch.randint(0, 256, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(input_ids=tokens).logits - ours(tokens)).abs().max().item() < 1e-5


@pytest.mark.timeout(600)
def test_phi3_saved_at_tp2_resumes_at_tp1(runs, models, data_dir: Path, tmp_path: Path) -> None:
    """Phi-3's parts are named alike at every tp: its tp2 checkpoint of step 2 resumes in one
    process, whose step 3 continues the tp2 run. Not bit-equal: step 3 sums the row-split dot
    products in another order (fp32 rounding; measured: the same losses, weights within 7.5e-9)."""
    full = runs("phi3-tp2")
    run = interrupted_copy(full, tmp_path / "run", at_step=2)
    args = tiny(data_dir, run, **{**BASE, "model.hf": models["phi3"], "checkpoint.interval": 2})
    assert "resumed from" in train_job(args, tmp_path=tmp_path).stderr
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3]
    assert losses(run) == pytest.approx(losses(full), rel=1e-5)
    assert max_weight_diff(final_weights(run), final_weights(full)) < 1e-5


def test_sample_reads_a_phi3_tp2_checkpoint(runs, tmp_path: Path) -> None:
    """`meshrun sample` runs one process through the parts (FusedParts) with the whole head counts."""
    sampled = meshrun_in_process(["sample", runs("phi3-tp2"), "--tokens", "8", "--seed", "3"], tmp_path=tmp_path)
    assert sampled.stdout.strip()
