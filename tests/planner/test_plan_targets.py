"""What `meshrun plan` plans is what runs: the precision `auto` resolves to (training's rule, on
the planned device), and the fixed floors a GPU step cannot go below (issue 29: a tiny model was
once predicted at 13 us per step on an H100)."""

from __future__ import annotations

import argparse

import pytest
import torch

from meshrun.cli.plan import hardware
from meshrun.config.schema import load_config
from meshrun.hardware.peaks import KERNEL_LAUNCH_S, KERNELS_PER_UNIT, STEP_FLOOR_S
from meshrun.hardware.precision import resolve_precision
from meshrun.planner.cost import Efficiency
from meshrun.planner.search import predict


def args(gpu: str) -> argparse.Namespace:
    return argparse.Namespace(
        gpu=gpu, gpus=2, nodes=1, memory_gb=None, intra_gbs=None, inter_gbs=None, calibration=None
    )


def test_auto_on_a_cpu_is_what_training_resolves_here() -> None:
    assert hardware(args("cpu"), "auto")[1] == resolve_precision("auto", torch.device("cpu")).precision


@pytest.mark.parametrize(
    ("gpu", "requested", "planned"),
    [
        ("h100", "auto", "bf16"),
        ("a100-80g", "auto", "bf16"),
        ("v100-16g", "auto", "fp16"),
        ("t4", "auto", "fp16"),
        ("h100", "fp32", "fp32"),
    ],
)
def test_auto_on_a_gpu_follows_its_bf16_tensor_cores(gpu: str, requested: str, planned: str) -> None:
    assert hardware(args(gpu), requested)[1] == planned


def test_a_tiny_model_on_an_h100_costs_at_least_its_floors() -> None:
    cfg = load_config(
        None,
        [
            "model.num_layers=2",
            "model.dim=32",
            "model.num_heads=2",
            "model.seq_len=16",
            "train.global_batch=4",
            "train.micro_batch=1",
            "parallel.dp=1",
            "parallel.pp=1",
        ],
    )
    hw, precision = hardware(args("h100"), cfg.precision)
    prediction = predict(cfg, hw, Efficiency(), precision=precision, margin=0.0)
    units = cfg.model.num_layers + 2  # blocks, embedding, head
    floor = STEP_FLOOR_S + cfg.accumulation_steps * units * KERNELS_PER_UNIT * KERNEL_LAUNCH_S
    assert prediction.time.total >= floor
    assert prediction.time.fixed == STEP_FLOOR_S and prediction.memory.baseline == Efficiency().runtime_bytes
