"""Activation recompute changes memory, never gradients."""

from __future__ import annotations

import pytest
import torch

from meshrun.config.schema import load_config
from meshrun.parallel.materialise import materialise_part
from meshrun.training.loss import MicrobatchLoss


def gradients(policy: str) -> dict[str, torch.Tensor]:
    cfg = load_config(
        None,
        [
            "model.num_layers=4",
            "model.dim=32",
            "model.num_heads=2",
            "model.seq_len=16",
            "precision=fp32",
            f"recompute={policy}",
        ],
    )
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    MicrobatchLoss(1)(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["full", "every:2", "selective"])
def test_recompute_gives_identical_gradients(policy: str) -> None:
    plain, recomputed = gradients("none"), gradients(policy)
    names = {n.replace("._checkpoint_wrapped_module", "") for n in recomputed}
    assert names == set(plain)
    for name, grad in recomputed.items():
        assert torch.allclose(grad, plain[name.replace("._checkpoint_wrapped_module", "")], atol=1e-6, rtol=0), name


def test_every_n_wraps_only_the_chosen_blocks() -> None:
    cfg = load_config(None, ["model.num_layers=4", "recompute=every:2"])
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    wrapped = [key for key, block in model.blocks.items() if hasattr(block, "_checkpoint_wrapped_module")]
    assert wrapped == ["0", "2"]
