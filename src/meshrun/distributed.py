"""Process group, device and backend (chosen here and nowhere else), and the (pp, dp) mesh.

Rank layout: pp is the outer mesh axis and dp the inner one, so
`rank = pp_rank * dp + dp_rank`. The dp replicas of one stage are neighbouring ranks (same
node on a multi-GPU machine: gradient all-reduce, the heavy traffic, stays on fast links),
while consecutive pipeline stages are `dp` ranks apart (activations are small p2p messages).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshrun.launcher.torchrun import in_launched_worker


def local_device() -> torch.device:
    """This process's device: the GPU LOCAL_RANK picks when CUDA is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def rank_memory_bytes(ranks_per_node: int) -> tuple[int, str]:
    """Memory one rank has here (bytes) and what it is, for --dry-run's warning: the GPU's own
    memory, else the host's RAM shared by this node's ranks."""
    device = local_device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the {props.total_memory / 2**30:.1f} GiB of this machine's {props.name}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = host // ranks_per_node
    if ranks_per_node == 1:
        return share, f"this host's {host / 2**30:.1f} GiB"
    return share, f"its {share / 2**30:.1f} GiB share of this host's {host / 2**30:.1f} GiB ({ranks_per_node} ranks)"


def pick_device() -> tuple[torch.device, str]:
    """CUDA + nccl when a GPU is visible (LOCAL_RANK picks it), else CPU + gloo."""
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return device, "nccl"
    return device, "gloo"


@dataclass(frozen=True)
class PrecisionChoice:
    """What `precision` means on this device, why, and a warning when it will be slow."""

    precision: str
    reason: str
    warning: str | None = None


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """`auto` -> bf16 where the hardware computes it natively (CUDA compute capability >= 8.0,
    a CPU with AVX512-BF16 or AMX), fp16 with loss scaling on older GPUs, fp32 otherwise.
    Explicit values are kept; bf16 without native support gets a warning (emulated bf16
    measured 8x slower than fp32 on an AVX2 CPU: 1695 vs 214 ms per step)."""
    native, hardware = _native_bf16(device)
    if requested == "auto":
        if native:
            return PrecisionChoice("bf16", f"precision auto -> bf16: {hardware} computes bf16 natively")
        if device.type == "cuda":
            return PrecisionChoice("fp16", f"precision auto -> fp16 with loss scaling: {hardware} has no fast bf16")
        return PrecisionChoice("fp32", f"precision auto -> fp32: {hardware} would emulate bf16 (about 8x slower)")
    warning = None
    if requested == "bf16" and not native:
        slowdown = "about 8x slower than fp32" if device.type == "cpu" else "slower than fp16"
        warning = f"precision bf16 on {hardware} is emulated, expect it to be {slowdown}; set precision=auto"
    return PrecisionChoice(requested, f"precision {requested} (set in the config)", warning)


def _native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bf16 in hardware, and the hardware named for messages."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return major >= 8, f"GPU {torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    isa = torch.backends.cpu.get_cpu_capability()
    native = sorted(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if native and limit in _ONEDNN_ISAS_WITHOUT_BF16:
        return False, f"this CPU limited by ONEDNN_MAX_CPU_ISA={limit}"
    if native:
        return True, f"this CPU ({isa}, {' and '.join(native)})"
    return False, f"this CPU ({isa}, no avx512_bf16 or amx_bf16)"


# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) below AVX512_CORE_BF16: bf16 matmuls are emulated
_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def _cpu_flags() -> set[str]:
    """CPU feature flags from /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the dp x pp mesh, with the process groups of each axis."""

    device: torch.device
    device_mesh: DeviceMesh
    dp: int
    pp: int
    data_mesh: DeviceMesh | None = None  # fsdp: the dp axis; hsdp: (dp_replicate, dp_shard); ddp: None

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        return self.device_mesh.get_local_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.device_mesh.get_local_rank("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_mesh(*, dp: int, pp: int, dp_mode: str = "ddp", dp_shard: int | None = None) -> Mesh:
    """Join (or, for a lone process, create) the process group and build the mesh (the world
    size was checked against dp x pp by `preflight.check_worker_env` before workers started)."""
    device, backend = pick_device()
    if in_launched_worker():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:  # one process started directly: no ports, no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device_mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    data_mesh = None
    if dp_mode == "fsdp":
        data_mesh = device_mesh["dp"]
    elif dp_mode == "hsdp" and dp_shard:
        # dp_rank = replica * dp_shard + shard: a copy is sharded over neighbouring ranks (one node's fast links)
        hybrid = init_device_mesh(
            device.type, (pp, dp // dp_shard, dp_shard), mesh_dim_names=("pp", "dp_replicate", "dp_shard")
        )
        data_mesh = hybrid["dp_replicate", "dp_shard"]
    return Mesh(device=device, device_mesh=device_mesh, dp=dp, pp=pp, data_mesh=data_mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
