"""Known GPUs: memory and dense peak FLOP/s from the vendor's datasheets, looked up by CUDA name.

One table for everything that needs a device's capacity (MFU here, the planner later). A name
matches an entry only when one of the entry's patterns matches the WHOLE name string that
`torch.cuda.get_device_name` returns (`re.fullmatch`): substring matching once read an
"NVIDIA L40" as an L4. Peaks are dense (no 2:4 sparsity) tensor-core rates with fp32
accumulation; `fp32_tflops` is the non-tensor-core FP32 rate (torch's default matmul, TF32 off).
A name that matches nothing is unknown: callers get None, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    key: str
    patterns: tuple[str, ...]  # regexes that must match the whole CUDA device name
    memory_gib: float  # datasheet capacity (device memory is sold in binary units: "80GB" = 80 GiB)
    bf16_tflops: float | None  # dense; None where the device has no bf16 tensor cores
    fp16_tflops: float
    fp32_tflops: float
    source: str  # datasheet or whitepaper the numbers come from

    def peak(self, precision: str) -> float | None:
        """Dense peak TFLOP/s for a training precision ('bf16', 'fp16' or 'fp32')."""
        return {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp32": self.fp32_tflops}.get(precision)


_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_GA102 = "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"

DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("B200", (r"NVIDIA B200",), 180, 2250, 2250, 75, "https://www.nvidia.com/en-us/data-center/hgx/"),
    DeviceSpec("H200", (r"NVIDIA H200",), 141, 989, 989, 67, "https://www.nvidia.com/en-us/data-center/h200/"),
    DeviceSpec("H200 NVL", (r"NVIDIA H200 NVL",), 141, 835, 835, 60, "https://www.nvidia.com/en-us/data-center/h200/"),
    DeviceSpec(
        "GH200",
        (r"NVIDIA GH200 480GB",),
        96,
        989,
        989,
        67,
        "https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip",
    ),
    DeviceSpec("H100 SXM", (r"NVIDIA H100 80GB HBM3",), 80, 989, 989, 67, _H100),
    DeviceSpec("H100 PCIe", (r"NVIDIA H100 PCIe",), 80, 756, 756, 51, _H100),
    DeviceSpec("H100 NVL", (r"NVIDIA H100 NVL",), 94, 835, 835, 60, _H100),
    DeviceSpec("A100 40GB", (r"NVIDIA A100-(SXM4|PCIE)-40GB",), 40, 312, 312, 19.5, _A100),
    DeviceSpec("A100 80GB", (r"NVIDIA A100-SXM4-80GB", r"NVIDIA A100 80GB PCIe"), 80, 312, 312, 19.5, _A100),
    DeviceSpec(
        "A10", (r"NVIDIA A10",), 24, 125, 125, 31.2, "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"
    ),
    DeviceSpec("L40S", (r"NVIDIA L40S",), 48, 362, 362, 91.6, "https://www.nvidia.com/en-us/data-center/l40s/"),
    DeviceSpec("L40", (r"NVIDIA L40",), 48, 181, 181, 90.5, "https://www.nvidia.com/en-us/data-center/l40/"),
    DeviceSpec("L4", (r"NVIDIA L4",), 24, 121, 121, 30.3, "https://www.nvidia.com/en-us/data-center/l4/"),
    DeviceSpec("RTX 4090", (r"NVIDIA GeForce RTX 4090",), 24, 165.2, 165.2, 82.6, _ADA),
    DeviceSpec("RTX 3090", (r"NVIDIA GeForce RTX 3090",), 24, 71, 71, 35.6, _GA102),
    DeviceSpec("V100 SXM2 16GB", (r"Tesla V100-SXM2-16GB",), 16, None, 125, 15.7, _V100),
    DeviceSpec("V100 SXM2 32GB", (r"Tesla V100-SXM2-32GB",), 32, None, 125, 15.7, _V100),
    DeviceSpec("V100 PCIe 16GB", (r"Tesla V100-PCIE-16GB",), 16, None, 112, 14, _V100),
    DeviceSpec("V100 PCIe 32GB", (r"Tesla V100-PCIE-32GB",), 32, None, 112, 14, _V100),
    DeviceSpec("T4", (r"Tesla T4",), 16, None, 65, 8.1, "https://www.nvidia.com/en-us/data-center/tesla-t4/"),
)


def find_device(name: str) -> DeviceSpec | None:
    """The entry whose pattern matches the whole CUDA device name (whitespace-normalised), or None."""
    normalised = " ".join(name.split())
    matches = [spec for spec in DEVICES if any(re.fullmatch(p, normalised) for p in spec.patterns)]
    return matches[0] if len(matches) == 1 else None


# Short names for `meshrun plan --gpu` (lower case), each naming one entry above.
SHORT_NAMES: dict[str, str] = {
    "b200": "B200",
    "h200": "H200",
    "h200-nvl": "H200 NVL",
    "gh200": "GH200",
    "h100": "H100 SXM",
    "h100-pcie": "H100 PCIe",
    "h100-nvl": "H100 NVL",
    "a100-40g": "A100 40GB",
    "a100-80g": "A100 80GB",
    "a10": "A10",
    "l40s": "L40S",
    "l40": "L40",
    "l4": "L4",
    "rtx4090": "RTX 4090",
    "rtx3090": "RTX 3090",
    "v100-16g": "V100 SXM2 16GB",
    "v100-32g": "V100 SXM2 32GB",
    "t4": "T4",
}

# Link bandwidth defaults in GB/s per GPU and direction: (within a node, between nodes). Within a
# node: NVLink where the SXM boards have it (H100/H200 450, A100 300, V100 150, B200 900), else
# PCIe (Gen5 x16 64, Gen4 32, Gen3 16). Between nodes: one NIC per GPU of the usual cluster
# build (400 Gb/s InfiniBand for Hopper/Blackwell, 200 Gb/s for A100, 100 Gb/s otherwise).
# These are defaults for planning only; `meshrun plan --intra-gbs/--inter-gbs` override them.
LINKS_GBS: dict[str, tuple[float, float]] = {
    "B200": (900, 50),
    "H200": (450, 50),
    "H200 NVL": (450, 50),
    "GH200": (450, 50),
    "H100 SXM": (450, 50),
    "H100 PCIe": (64, 50),
    "H100 NVL": (300, 50),
    "A100 40GB": (300, 25),
    "A100 80GB": (300, 25),
    "V100 SXM2 16GB": (150, 12.5),
    "V100 SXM2 32GB": (150, 12.5),
    "T4": (16, 12.5),
}
PCIE4_LINKS_GBS = (32.0, 12.5)


def device_by_short_name(name: str) -> DeviceSpec:
    """The entry for a `--gpu` short name; unknown names are a KeyError listing the known ones."""
    key = SHORT_NAMES.get(name.lower())
    if key is None:
        raise KeyError(f"unknown GPU {name!r}: use one of {', '.join(SHORT_NAMES)}")
    return next(spec for spec in DEVICES if spec.key == key)


def links_gbs(spec: DeviceSpec) -> tuple[float, float]:
    """(intra-node, inter-node) GB/s defaults for this device."""
    return LINKS_GBS.get(spec.key, PCIE4_LINKS_GBS)


# Fixed costs no GPU step goes below, for plans made before `meshrun plan --calibrate` ran on the
# GPU (which measures them there). The same for every entry above: they are the host's and the
# runtime's costs more than the chip's. Estimates with their sources; calibration replaces them.
KERNEL_LAUNCH_S = 5e-6  # one CUDA kernel launch: 4-6 us measured (https://susun-blog.com/blog/pegainfer-3-cuda-graph,
# RTX 5070 Ti, CUDA 13); NVIDIA's https://developer.nvidia.com/blog/cuda-graphs/ sizes it "a few microseconds"
KERNELS_PER_UNIT = 60  # eager kernels of one block per microbatch, forward (~20: norms, q k v o, attention,
# MLP, residuals) and backward (~40): counted from a transformer block's ops, an estimate
STEP_FLOOR_S = 1e-3  # per optimizer step: fused AdamW, foreach clip-norm, zero_grad and the loss's host sync,
# about 200 launches (~40 kernels per parameter group and phase) at KERNEL_LAUNCH_S: an estimate
MESSAGE_FLOOR_S = 2e-5  # per NCCL send/receive or small all-reduce: NCCL's small-message latency is
# 10-30 us within an NVLink node (its LL protocol; nccl-tests' 8-byte rows, https://github.com/NVIDIA/nccl-tests)
RUNTIME_BYTES = 1 << 30  # per GPU rank before the model: the CUDA context and its kernels' code (0.3-0.6 GiB
# for torch's CUDA libraries, seen as nvidia-smi's use minus torch.cuda.memory_reserved), NCCL's buffers
# (NCCL_BUFFSIZE 4 MiB per channel and peer, https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)
# and the caching allocator's fragmentation: an estimate, measured by --calibrate on the GPU
