"""A GPT that writes the dtype of every Linear output it computes to
`$MESHRUN_TEST_DTYPES/<pid>.txt` (each dtype once per process): proof, from a real run, that
autocast reached the matmuls of every stage. Same parameters and numerics as the plain GPT;
used through `model.factory: dtype_probe_gpt:build`."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT


def build(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    seen: set[torch.dtype] = set()

    def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if output.dtype not in seen:
            seen.add(output.dtype)
            with (Path(os.environ["MESHRUN_TEST_DTYPES"]) / f"{os.getpid()}.txt").open("a") as log:
                log.write(f"{output.dtype}\n")

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(record)
    return model


def recorded(folder: Path) -> dict[str, set[str]]:
    """pid -> dtypes its Linear layers produced."""
    return {path.stem: set(path.read_text().split()) for path in folder.glob("*.txt")}
