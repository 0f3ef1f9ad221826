"""Precision: what `precision: auto` means on this device, the one map from config names to torch dtypes,
the autocast context, and the fp16 loss scaler that all pipeline stages agree on."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from meshrun.config.schema import Config
from meshrun.errors import RunError
from meshrun.files.console import say

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.precision])


def make_scaler(cfg: Config, device: torch.device, group: dist.ProcessGroup | None) -> ShardedGradScaler | None:
    """fp16 only. The scaler all-reduces found_inf over `group` (the pipeline stages), so when
    one stage overflows every stage skips the same step and backs off the same scale."""
    if cfg.precision != "fp16":
        return None
    scaler = ShardedGradScaler(
        device.type, init_scale=cfg.amp.init_scale, growth_interval=cfg.amp.growth_interval, process_group=group
    )
    scaler.scale(torch.zeros((), device=device))  # creates the scale now: non-last stages never scale a loss
    return scaler


@dataclass(frozen=True)
class PrecisionChoice:
    """What `precision` means on this device, why, and a warning when it will be slow."""

    precision: str
    reason: str
    warning: str | None = None


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """What `requested` means on `device` (see `choose_precision`)."""
    native, hardware = _native_bf16(device)
    return choose_precision(requested, native_bf16=native, gpu=device.type == "cuda", hardware=hardware)


def choose_precision(requested: str, *, native_bf16: bool, gpu: bool, hardware: str) -> PrecisionChoice:
    """`auto` -> bf16 where the hardware computes it natively (CUDA compute capability >= 8.0,
    a CPU with AVX512-BF16 or AMX), fp16 with loss scaling on older GPUs, fp32 otherwise.
    Explicit values are kept; bf16 without native support gets a warning (emulated bf16
    measured 8x slower than fp32 on an AVX2 CPU: 1695 vs 214 ms per step). The one rule: training
    applies it to its device, `meshrun plan` to the device it plans for (a GPU table entry)."""
    if requested == "auto":
        if native_bf16:
            return PrecisionChoice("bf16", f"precision auto -> bf16: {hardware} computes bf16 natively")
        if gpu:
            return PrecisionChoice("fp16", f"precision auto -> fp16 with loss scaling: {hardware} has no fast bf16")
        return PrecisionChoice("fp32", f"precision auto -> fp32: {hardware} would emulate bf16 (about 8x slower)")
    warning = None
    if requested == "bf16" and not native_bf16:
        slowdown = "slower than fp16" if gpu else "about 8x slower than fp32"
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


def with_resolved_precision(cfg: Config, device: torch.device, *, speaks: bool) -> Config:
    """Collective: the config with `precision` resolved for this hardware (what config.json and the
    tracker record). The rank that `speaks` says what was chosen and why; all ranks must agree
    (mixed hardware with `auto` could pick different dtypes for the stages of one pipeline)."""
    choice = resolve_precision(cfg.precision, device)
    choices: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(choices, choice.precision)
    if len(set(choices)) > 1:
        raise RunError(
            f"precision {cfg.precision} means {' / '.join(sorted(set(map(str, choices))))} on different nodes "
            "(their hardware differs); set precision explicitly"
        )
    if speaks:
        say(choice.reason)
        if choice.warning:
            say(f"warning: {choice.warning}")
    return cfg.model_copy(update={"precision": choice.precision})
