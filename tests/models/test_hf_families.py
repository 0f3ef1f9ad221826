"""Each family layout (llama, qwen2, qwen3, mistral, phi3, olmo2, tied llama), split into pipeline stages
in one process from save_pretrained weights, computes the transformers model's logits, and on a
packed row each document's logits as if it ran alone."""

from __future__ import annotations

from pathlib import Path

import pytest

SMALL = {  # a tiny decoder: 4 layers of width 32, grouped-query attention
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
FAMILY_CONFIGS = {
    "qwen2": {"model_type": "qwen2", **SMALL},
    "qwen3": {"model_type": "qwen3", **SMALL, "head_dim": 16},
    "mistral": {"model_type": "mistral", **SMALL, "sliding_window": 32},
    "phi3": {"model_type": "phi3", **SMALL, "partial_rotary_factor": 0.5, "pad_token_id": 0},  # fused qkv, gate_up
    "olmo2": {"model_type": "olmo2", **SMALL, "pad_token_id": 0},  # norms after attention and MLP, q/k norms
    "llama-tied": {"model_type": "llama", **SMALL, "num_key_value_heads": 4, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_stages_chained_equal_transformers(family: str, tmp_path: Path) -> None:
    """Every family layout, split into two stages from saved weights, computes transformers' logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrun.config.schema import validate
    from meshrun.parallel.materialise import materialise_part

    fields = dict(FAMILY_CONFIGS[family])
    torch.manual_seed(0)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    reference.save_pretrained(tmp_path / "model")
    cfg = validate({"model": {"hf": str(tmp_path / "model"), "seq_len": 16}})
    stages = [
        materialise_part(cfg, torch.device("cpu"), layers=layers, first=i == 0, last=i == 1).eval()
        for i, layers in enumerate([[0, 1], [2, 3]])
    ]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = stages[1](stages[0](tokens))
        assert (ours - reference(input_ids=tokens).logits).abs().max().item() < 1e-5
        # packed rows (docs/guides/conversations.md): the positions travel from stage to stage and
        # each document's logits are its own, as if it ran alone
        lengths = [[5, 8, 3], [16]]
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
        packed = stages[1](*stages[0](torch.stack([tokens, positions], dim=1)))
        for r, row in enumerate(lengths):
            for start, n in zip([0, *torch.tensor(row).cumsum(0)[:-1].tolist()], row):
                alone = reference(input_ids=tokens[r : r + 1, start : start + n]).logits[0]
                assert (packed[r, start : start + n] - alone).abs().max().item() < 1e-5, (r, start)
    if config.tie_word_embeddings:  # the last stage holds its own copy of the tied matrix, same values
        assert torch.equal(stages[0].embed.weight, stages[1].embed.weight)


def test_a_folder_saved_in_bf16_trains_fp32_master_weights(tmp_path: Path) -> None:
    """Released checkpoints say `"dtype": "bfloat16"`: meshrun still holds fp32 parameters (the
    saved values, exactly), so AdamW's small updates are not rounded away."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrun.config.schema import validate
    from meshrun.parallel.materialise import materialise_part

    fields = dict(FAMILY_CONFIGS["qwen2"])
    torch.manual_seed(0)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, dtype="bfloat16")
    saved = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    saved.save_pretrained(tmp_path / "model")
    cfg = validate({"model": {"hf": str(tmp_path / "model"), "seq_len": 16}})
    model = materialise_part(cfg, torch.device("cpu"), layers=[0, 1, 2, 3], first=True, last=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    mine = model.blocks["0"].mlp.down_proj.weight
    assert torch.equal(mine, saved.model.layers[0].mlp.down_proj.weight.float())
