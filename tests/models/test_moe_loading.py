"""Pretrained MoE weights load per pipeline stage and per expert shard: under parallel.ep a rank
reads from a Hugging Face folder only its stage's tensors and only its own experts' (their own
tensors where the files hold one per expert, their rows of a 3-D tensor where the files hold the
experts fused), and never makes a tensor of every expert. Each family: Qwen3-MoE, Qwen2-MoE with
its shared expert, Mixtral (block_sparse_moe names), OLMoE; one launch (tests/models/moe_load_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import meshrun_env
from test_moe import MOE_FAMILIES

WORKER = Path(__file__).with_name("moe_load_worker.py")
# the experts dominate (8 x 256 x 32 per layer's gate_up_proj, 4x the embedding): the largest tensor
# a rank makes tells whether it ever held every expert
WIDE = {
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 128},
    "qwen2_moe": {"num_experts": 8, "moe_intermediate_size": 128},
    "mixtral": {"num_local_experts": 8, "intermediate_size": 128},
    "olmoe": {"num_experts": 8, "intermediate_size": 128},
}
FUSED = ("qwen3_moe", "mixtral")  # also written as a transformers 5 state dict: 3-D experts tensors


def save(family: str, out: Path, *, fused: bool) -> Path:
    """transformers' own model of the family (seeded init), as save_pretrained writes it (one tensor
    per expert) or as its state dict (`fused`: mlp.experts.gate_up_proj, which transformers loads as is)."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.AutoConfig.for_model(family, **{**MOE_FAMILIES[family], **WIDE[family]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if not fused:
        model.save_pretrained(out)
        return out
    out.mkdir()
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One 2-rank launch over every folder; each key `folder/stage` -> rank -> what it measured."""
    tmp = tmp_path_factory.mktemp("moe_load")
    folders = [save(f, tmp / f, fused=False) for f in MOE_FAMILIES]
    folders += [save(f, tmp / f"{f}_fused", fused=True) for f in FUSED]
    argv = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    env = meshrun_env(tmp, PYTHONPATH=str(WORKER.parents[1]))
    done = subprocess.run(
        [*argv, str(tmp), *map(str, folders)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(2)]
    return {key: {r: found[key] for r, found in enumerate(ranks)} for key in ranks[0]}


FOLDERS = [*MOE_FAMILIES, *(f"{f}_fused" for f in FUSED)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("folder", FOLDERS)
def test_each_rank_loads_its_stage_and_experts_bit_equal_to_transformers(measured: dict, folder: str) -> None:
    """Every tensor a rank holds (the whole model, or the last of two stages) equals its rows of
    transformers' own load of the folder, bit for bit; the whole ep2 model's logits equal transformers'."""
    for stage in ("whole", "last_stage"):
        for rank, found in measured[f"{folder}/{stage}"].items():
            assert found["equal"] and all(found["equal"].values()), (stage, rank, found["equal"])
    for found in measured[f"{folder}/whole"].values():
        assert found["logits"] < 1e-5


@pytest.mark.timeout(400)
@pytest.mark.parametrize("folder", FOLDERS)
def test_a_rank_reads_and_makes_only_its_own_experts(measured: dict, folder: str) -> None:
    """The bytes a rank reads from the files are the bytes its stage holds (no other stage's tensors,
    no other rank's experts), and no tensor it makes is as large as a layer's whole experts tensor:
    none larger than its own share (built whole then cut, the whole would be made first)."""
    for stage in ("whole", "last_stage"):
        for found in measured[f"{folder}/{stage}"].values():
            assert found["read"] == found["held"], (stage, found["read"], found["held"])
            assert found["largest"] <= found["rank_experts"] < found["whole_experts"], (stage, found)


@pytest.mark.parametrize(
    "model",
    [
        {"moe": {"num_experts": 4}, "num_layers": 2, "dim": 32, "num_heads": 2, "vocab_size": 256},
        {"hf_config": {"model_type": "qwen3_moe", **MOE_FAMILIES["qwen3_moe"]}},
    ],
    ids=["built-in", "qwen3_moe"],
)
def test_a_rank_seeded_experts_are_its_rows_of_the_whole_models(model: dict) -> None:
    """No folder (a seeded init): each ep rank's stage, cut to its experts before it is made, holds
    exactly its rows of the whole model's values (the layout does not change the start)."""
    from meshrun.config.schema import validate
    from meshrun.models.moe import held_experts
    from meshrun.parallel.materialise import materialise_part

    cfg = validate({"model": {"seq_len": 16, **model}})
    whole = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True).state_dict()
    for rank in range(2):
        part = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True, ep_rank=(rank, 2))
        cut = 0
        for name, tensor in part.state_dict().items():
            owner, _, param = name.rpartition(".")
            want = whole[name]
            if param in ("gate_up_proj", "down_proj"):
                held = held_experts(part.get_submodule(owner))
                assert (held.first, held.count, held.total) == (2 * rank, 2, 4)
                want, cut = want[held.first : held.first + held.count], cut + 1
            assert torch.equal(tensor, want), name
        assert cut >= 2
