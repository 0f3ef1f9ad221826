"""The GPU table: every entry is found by its own CUDA device name and by no other entry's,
carries a source, and unknown names get no peak at all (MFU omitted, never a wrong guess)."""

from __future__ import annotations

import re

import pytest
import torch

from meshrun.hardware.peaks import DEVICES, find_device
from meshrun.metrics.meters import mfu_note, peak_tflops, throughput

# What torch.cuda.get_device_name returns on each device (as printed by nvidia-smi / torch).
CUDA_NAMES = {
    "B200": ["NVIDIA B200"],
    "H200": ["NVIDIA H200"],
    "H200 NVL": ["NVIDIA H200 NVL"],
    "GH200": ["NVIDIA GH200 480GB"],
    "H100 SXM": ["NVIDIA H100 80GB HBM3"],
    "H100 PCIe": ["NVIDIA H100 PCIe"],
    "H100 NVL": ["NVIDIA H100 NVL"],
    "A100 40GB": ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"],
    "A100 80GB": ["NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"],
    "A10": ["NVIDIA A10"],
    "L40S": ["NVIDIA L40S"],
    "L40": ["NVIDIA L40"],
    "L4": ["NVIDIA L4"],
    "RTX 4090": ["NVIDIA GeForce RTX 4090"],
    "RTX 3090": ["NVIDIA GeForce RTX 3090"],
    "V100 SXM2 16GB": ["Tesla V100-SXM2-16GB"],
    "V100 SXM2 32GB": ["Tesla V100-SXM2-32GB"],
    "V100 PCIe 16GB": ["Tesla V100-PCIE-16GB"],
    "V100 PCIe 32GB": ["Tesla V100-PCIE-32GB"],
    "T4": ["Tesla T4"],
}
UNKNOWN = [
    "NVIDIA A10G",
    "NVIDIA L4 Ti",
    "NVIDIA H100",
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA A100",
    "AMD Instinct MI300X",
    "NVIDIA L40SX",
    "Tesla T40",
    "NVIDIA A800-SXM4-80GB",
    "",
]


def test_every_entry_has_a_named_device_here() -> None:
    assert sorted(CUDA_NAMES) == sorted(spec.key for spec in DEVICES), "add the new entry's CUDA names to CUDA_NAMES"
    assert len({spec.key for spec in DEVICES}) == len(DEVICES)


@pytest.mark.parametrize("key,name", [(k, n) for k, names in CUDA_NAMES.items() for n in names], ids=str)
def test_cuda_name_finds_its_own_entry_and_no_other(key: str, name: str) -> None:
    matching = [spec.key for spec in DEVICES if any(re.fullmatch(p, name) for p in spec.patterns)]
    assert matching == [key]
    assert find_device(name).key == key
    assert find_device(f"  {name} ").key == key  # surrounding whitespace is not part of the name


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_names_are_unknown(name: str) -> None:
    assert find_device(name) is None


@pytest.mark.parametrize("spec", DEVICES, ids=lambda s: s.key)
def test_every_entry_is_sourced_and_plausible(spec) -> None:
    assert spec.source.startswith("https://") and " " not in spec.source
    assert spec.memory_gib >= 16
    peaks = [p for p in (spec.bf16_tflops, spec.fp16_tflops) if p is not None]
    assert all(p > spec.fp32_tflops for p in peaks), "tensor-core peaks exceed the plain fp32 rate"
    assert spec.fp32_tflops > 0 and spec.peak("fp32") == spec.fp32_tflops and spec.peak("fp16") == spec.fp16_tflops


def test_l40_is_not_an_l4() -> None:
    """The bug this table replaced: substring matching read "NVIDIA L40" as an L4 (121 TFLOP/s)."""
    assert find_device("NVIDIA L40").bf16_tflops == 181
    assert find_device("NVIDIA L4").bf16_tflops == 121
    assert find_device("NVIDIA L40S").bf16_tflops == 362


def test_peak_for_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's lookup: configured value first; CPU unknown; the GPU table by precision; no bf16 on a V100."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert peak_tflops(cpu, None) is None and mfu_note(cpu, None) is None
    assert peak_tflops(cpu, 42.0) == 42.0
    device_name = {"name": ""}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name["name"])
    device_name["name"] = "NVIDIA L40"
    assert peak_tflops(cuda, None, "bf16") == 181 and peak_tflops(cuda, None, "fp32") == 90.5
    device_name["name"] = "Tesla V100-SXM2-16GB"
    assert peak_tflops(cuda, None, "bf16") is None and peak_tflops(cuda, None, "fp16") == 125
    device_name["name"] = "NVIDIA A10G"
    assert peak_tflops(cuda, None, "bf16") is None
    assert mfu_note(cuda, None) == (
        "MFU omitted: no peak TFLOP/s known for 'NVIDIA A10G' at this precision; set metrics.peak_tflops to report it"
    )
    assert mfu_note(cuda, 125.0) is None
    assert "mfu" not in throughput(tokens=100, seconds=1.0, flops=600.0, world_size=1, peak=None)
