"""Activation offload (train.offload_activations) on a CPU: the blocks it selects run under torch's
saved-tensor hooks (save_on_cpu's, strides kept), every tensor their backward needs passes through its host copy, and training gives
bit-identical fp32 results with it on or off, alone and beside recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import in_process_trainer
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from meshrun.config.schema import load_config
from meshrun.parallel.materialise import materialise_part
from meshrun.parallel.offload import OffloadedBlock, apply_offload


def trained(data_dir: Path, run: Path, **overrides: object) -> dict[str, torch.Tensor]:
    """The weights after 3 steps of meshrun's real Trainer on one process."""
    with in_process_trainer(data_dir, run, **{"train.steps": 3, **overrides}) as trainer:
        trainer.train()
        return {k: v.clone() for k, v in trainer.model.parts[0].state_dict().items()}


@pytest.mark.parametrize(
    ("offload", "recompute", "compile"),
    [(True, "none", False), ("every:2", "none", False), (True, "every:2", False), (True, "none", True)],
    ids=["all", "every2", "beside-recompute", "compiled"],  # compiled: its backward checks the saved strides
)
def test_offload_trains_bit_identically(
    offload: object, recompute: str, compile: bool, data_dir: Path, tmp_path: Path
) -> None:
    same = {"recompute": recompute, "train.compile": compile}
    plain = trained(data_dir, tmp_path / "plain", **same)
    ours = trained(data_dir, tmp_path / "ours", **same, **{"train.offload_activations": offload})
    assert ours.keys() == plain.keys()  # the wrapper's state-dict hooks keep the names
    assert all(torch.equal(ours[k], plain[k]) for k in plain)


def test_a_block_is_either_recomputed_or_offloaded() -> None:
    cfg = load_config(None, ["model.num_layers=4", "recompute=every:2", "train.offload_activations=true"])
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    apply_offload(model.blocks, cfg.train.offload_activations, recompute=cfg.recompute)
    kinds = {key: type(block) for key, block in model.blocks.items()}
    assert kinds == {"0": CheckpointWrapper, "1": OffloadedBlock, "2": CheckpointWrapper, "3": OffloadedBlock}


def saved_on_the_device(offload: object) -> int:
    """The tensors a 2-block GPT saves for backward outside save_on_cpu: an outer saved-tensor hook
    sees only those that no inner hook (the offloaded blocks' save_on_cpu) takes first."""
    cfg = load_config(None, ["model.num_layers=2", f"train.offload_activations={offload}"])
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    apply_offload(model.blocks, cfg.train.offload_activations, recompute=cfg.recompute)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    seen: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(tokens[:, :-1]).sum().backward()
    return len(seen)


def test_saved_activations_of_offloaded_blocks_leave_the_device() -> None:
    none, half, every = (saved_on_the_device(o) for o in (False, "every:2", True))
    assert none > half > every > 0  # block 0, then both blocks, saved through save_on_cpu; the head stays


def test_each_offloaded_block_prefetches_the_one_before_and_holds_nothing_after_backward() -> None:
    """The chain a CUDA backward prefetches along (parallel/offload.py): block 2's forward group
    names block 0's (the next offloaded block backward reaches); once backward has used them,
    nothing holds them (the chain keeps weak references: no host or device memory outlives it)."""
    cfg = load_config(None, ["model.num_layers=4", "train.offload_activations=every:2"])
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    apply_offload(model.blocks, cfg.train.offload_activations, recompute=cfg.recompute)
    first, third = model.blocks["0"], model.blocks["2"]
    assert isinstance(first, OffloadedBlock) and isinstance(third, OffloadedBlock) and first.chain is third.chain
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).sum()
    groups = {key: ref() for key, ref in first.chain.last.items()}
    assert set(groups) == {"0", "2"} and groups["0"] is not None and groups["2"] is not None
    assert groups["2"].previous is groups["0"] and groups["0"].previous is None
    del groups
    loss.backward()
    del loss
    assert all(ref() is None for ref in first.chain.last.values())
