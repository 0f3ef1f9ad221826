"""One torchrun worker of tests/models/test_moe_loading.py (2 ranks, gloo, dp2 x ep2): each pretrained
MoE folder (argv[2:]) built as a training rank builds its stage (parallelize.local_part: the whole
model, then the last of two pipeline stages) while every tensor an operation touches is watched.
Writes OUT/rank-R.json: per folder and stage, the bytes copied out of the files, the bytes the stage holds, the largest tensor made, this rank's expert tensor's bytes, whether
each tensor equals its rows of transformers' own load of the folder, and, for the whole model, the
largest difference of its ep2 logits (both ranks routing over the ep group) from transformers'."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshrun.config.schema import validate
from meshrun.launcher.lifetime import end_worker
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import mesh_on
from meshrun.parallel.parallelize import local_part

MAPPED = "aten.set_.source_Storage"  # safetensors hands torch a tensor's bytes as a storage over the mapped file


class Watched(TorchDispatchMode):
    """The bytes copied out of the files (rows of safetensors' tensors, which map the file: nothing is
    read until copied), and the largest storage made in memory by any operation."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = self.read = 0
        self.mapped: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func) == MAPPED:
            self.mapped.add(out.untyped_storage().data_ptr())
        elif func is torch.ops.aten.copy_.default and args[1].untyped_storage().data_ptr() in self.mapped:
            self.read += args[1].numel() * args[1].element_size()
        for tensor in tree_leaves((out, args, kwargs or {})):
            in_memory = isinstance(tensor, torch.Tensor) and not tensor.is_meta
            if in_memory and tensor.untyped_storage().data_ptr() not in self.mapped:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


def their_name(name: str) -> str:
    """Our tensor name -> transformers' state-dict name (the llama layout the MoE families share)."""
    for ours, theirs in (("embed.", "model.embed_tokens."), ("blocks.", "model.layers."), ("norm.", "model.norm.")):
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name.replace("head.", "lm_head.", 1)


def measured(folder: Path, stage: tuple[list[int] | None, bool], reference: torch.nn.Module) -> dict[str, Any]:
    cfg = validate({"model": {"hf": str(folder), "seq_len": 16}, "parallel": {"dp": 2, "ep": 2}})
    mesh = mesh_on(Layout(dp_replicate=2, ep=2), torch.device("cpu"))
    layers, first = stage
    with Watched() as watched:
        part = local_part(cfg, mesh, layers=layers, first=first, last=True)
    theirs = reference.state_dict()
    equal = {}
    for name, tensor in part.state_dict().items():
        want = theirs[their_name(name)]
        if (shard := getattr(part.get_submodule(name.rpartition(".")[0]), "expert_shard", None)) is not None:
            want = want[shard.first : shard.first + shard.count]
        equal[name] = torch.equal(tensor, want)
    experts = next(m for m in part.modules() if hasattr(m, "expert_shard"))
    found = {
        "read": watched.read,
        "held": sum(t.untyped_storage().nbytes() for t in part.state_dict().values()),
        "largest": watched.largest,
        "rank_experts": experts.gate_up_proj.untyped_storage().nbytes(),
        "whole_experts": experts.expert_shard.total * experts.gate_up_proj[0].nbytes,
        "equal": equal,
    }
    if first:
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            found["logits"] = (part(tokens) - reference(input_ids=tokens).logits).abs().max().item()
    return found


def main(out: Path, folders: list[Path]) -> None:
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    found = {}
    for folder in folders:
        reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
        for stage, (layers, first) in {"whole": (None, True), "last_stage": ([1, 2], False)}.items():
            found[f"{folder.name}/{stage}"] = measured(folder, (layers, first), reference.eval())
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
    end_worker(0)  # as meshrun's workers end: gloo can abort a finished process at finalization
