"""Low precision really runs in low precision: meshrun's own training step, in process, with
hooks on every Linear. (The loss-level tests in test_amp.py / test_pipeline.py would also pass
if autocast silently did nothing, since they compare with fp32 within a tolerance.)"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from meshrun.config.schema import load_config
from meshrun.hardware.precision import autocast
from meshrun.parallel.materialise import materialise_part
from meshrun.parallel.parallelize import LocalModel
from meshrun.training.loss import MicrobatchLoss

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "precision,dtype,recompute",
    [
        ("bf16", torch.bfloat16, "none"),
        ("bf16", torch.bfloat16, "full"),  # recomputed forwards run under autocast too
        ("fp16", torch.float16, "none"),
        ("fp32", torch.float32, "none"),
    ],
)
def test_matmuls_run_in_the_configured_precision(precision: str, dtype: torch.dtype, recompute: str) -> None:
    cfg = load_config(
        None,
        [
            "model.num_layers=2",
            "model.dim=32",
            "model.num_heads=2",
            "model.seq_len=16",
            "train.global_batch=4",
            "train.micro_batch=2",
            f"precision={precision}",
            f"recompute={recompute}",
        ],
    )
    part = materialise_part(cfg, CPU, layers=None, first=True, last=True)
    # The trainer builds its step exactly so: LocalModel with amp=partial(autocast, cfg, device).
    model = LocalModel(part, part, loss=MicrobatchLoss(cfg.accumulation_steps), amp=partial(autocast, cfg, CPU))
    seen: dict[str, set[torch.dtype]] = {}
    linears = [(name, m) for name, m in part.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        module.register_forward_hook(lambda m, args, out, name=name: seen.setdefault(name, set()).add(out.dtype))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    loss = model.forward_backward(tokens[:, :-1], tokens[:, 1:])
    assert len(seen) == len(linears) == 2 * 6 + 1  # q, k, v, proj, fc, proj per block; the head
    assert all(dtypes == {dtype} for dtypes in seen.values()), seen
    assert loss.dtype == torch.float32 and torch.isfinite(loss)  # cross-entropy in fp32
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in part.parameters()
    )  # fp32 master weights
