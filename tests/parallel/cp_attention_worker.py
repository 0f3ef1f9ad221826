"""One torchrun worker of test_context_attention.py: a model's step-1 loss and gradients with its
attention split by parallel/context.py over a cp group of 2, against the whole model on one rank.

Models: the built-in GPT (learned positions), and each Hugging Face decoder cp supports (Llama
also trains 10 steps at cp2 in tests/models/test_hf.py), built by transformers, saved and built from the
folder by meshrun as training builds it (rotary positions, grouped-query attention: 4 query and 2
key/value heads, one of each a rank inside attention). Rows: plain text and a packed batch
(documents crossing the chunk boundary), each with the real wrapper and the broken variant
`local-positions` (each rank's positions counted from 0, as if rotary or learned positions were
taken as local); GPT also `wrong-rank` (the second all-to-all sends a rank's positions to the other
rank). Rank 0 writes {row: [loss difference, max grad difference]} as JSON to argv[1].
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.config.model_sections import GPTSection
from meshrun.config.schema import validate
from meshrun.launcher.lifetime import end_worker
from meshrun.models.gpt import GPT
from meshrun.parallel import context
from meshrun.parallel.layout import Layout
from meshrun.parallel.materialise import materialise_part
from meshrun.parallel.mesh import init_mesh, shutdown

T, B = 16, 2
SMALL = {  # tests/models/test_hf_families.py's tiny decoder
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}
HF_FAMILIES = {  # CP_HF_TYPES (config/context.py)
    "llama": {"model_type": "llama", **SMALL},
    "qwen2": {"model_type": "qwen2", **SMALL},
    "qwen3": {"model_type": "qwen3", **SMALL, "head_dim": 16},
    "mistral": {"model_type": "mistral", **SMALL, "sliding_window": 32},
    "olmo2": {"model_type": "olmo2", **SMALL, "pad_token_id": 0},
}


def batch(packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) or ids and positions (B, 2, T), targets (B, T)): documents of 5, 7, 4 and 11, 5 tokens."""
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(2))
    if not packed:
        return ids, targets
    rows = [[5, 7, 4], [11, 5]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    return torch.stack([ids, positions], dim=1), targets


def hf_model(family: str, folder: Path) -> torch.nn.Module:
    """transformers' model of `family`, saved to `folder` by rank 0 and built from it by meshrun on
    every rank, whole, as a training stage."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dist.get_rank() == 0:
        fields = dict(HF_FAMILIES[family])
        torch.manual_seed(0)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(folder)
    dist.barrier()
    cfg = validate({"model": {"hf": str(folder), "seq_len": T}})
    return materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)


def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Summed token loss / the whole batch's count, one backward: (loss, gradients)."""
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / (B * T)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]  # pyright: ignore[reportOptionalMemberAccess]


def split_step(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mesh, broken: str | None
) -> tuple[float, list]:
    """The same step with positions over the cp group: losses and gradients summed over it."""
    model = context.apply_context_parallel(copy.deepcopy(model), mesh)  # pyright: ignore[reportAssignmentType]
    xs, ys = context.shard_batch(x, y, mesh)
    if broken == "local-positions":
        xs[:, 1] = torch.arange(xs.shape[-1])
    loss, grads = step(model, xs, ys)
    total = torch.tensor(loss)
    for t in (total, *grads):
        dist.all_reduce(t, group=mesh.group("cp"))
    return total.item(), grads


def wrong_rank(x: torch.Tensor, group: dist.ProcessGroup, *, split: int, join: int) -> torch.Tensor:
    """context.exchange whose return trip (heads -> positions) sends each piece to the other rank."""
    if split == 2:
        x = x.roll(x.shape[2] // 2, dims=2)
    return EXCHANGE(x, group, split=split, join=join)


EXCHANGE = context.exchange


def compare(name: str, model: torch.nn.Module, mesh, brokens: tuple[str, ...]) -> dict[str, list[float]]:
    """{row: [|loss - whole model's|, max |grad - whole model's|]} for `model` on both kinds of data."""
    found = {}
    for packed in (False, True):
        x, y = batch(packed)
        want_loss, want_grads = step(copy.deepcopy(model), x, y)
        for broken in (None, *brokens):
            context.exchange = wrong_rank if broken == "wrong-rank" else EXCHANGE
            loss, grads = split_step(model, x.clone(), y, mesh, broken)
            worst = max((a - b).abs().max().item() for a, b in zip(grads, want_grads))
            found[f"{name}{'packed' if packed else 'plain'}-{broken or 'cp2'}"] = [abs(loss - want_loss), worst]
    context.exchange = EXCHANGE
    return found


def main(out: str) -> None:
    mesh = init_mesh(Layout(cp=2))
    torch.manual_seed(0)
    cfg = GPTSection(vocab_size=64, dim=32, num_heads=4, num_layers=2, seq_len=T, dropout=0.0)
    with torch.device("cpu"):
        model = GPT(cfg)
    model.init_weights(0)
    found = compare("", model, mesh, ("local-positions", "wrong-rank"))
    for family in HF_FAMILIES:
        found |= compare(f"{family}-", hf_model(family, Path(out).parent / family), mesh, ("local-positions",))
    if mesh.rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)
    shutdown()
    end_worker(0)  # as meshrun's workers end: gloo can abort a finished process at finalization


if __name__ == "__main__":
    main(sys.argv[1])
