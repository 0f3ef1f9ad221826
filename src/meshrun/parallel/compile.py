"""`train.compile`: torch.compile per Transformer block, applied after TP and recompute, before
DDP/FSDP (torchtitan's order: the compiled graph holds the TP plan's DTensor hooks and the
recompute region; FSDP's all-gathers stay outside it).

Each block's `forward` is compiled on its own, not the whole model: a pipeline stage compiles only
its blocks, identical blocks share one graph (dynamo inlines nn.Modules and takes parameters as
inputs: one compilation for all layers of a GPT), and a graph break stays inside its block.
Compiling the block's `forward` (not its `__call__`, nor wrapping it in an OptimizedModule) keeps
the hooks on the block (FSDP2's) eager and every parameter name unchanged, so a checkpoint moves
between compiled and eager runs.

A block that cannot compile (a graph break, an unsupported op): with `compile: true` (explicit) the
run stops with one line naming the block and the reason; with `auto` it runs eager, after one
warning naming the block and the reason, and the other blocks stay compiled.

The inductor cache (compiled kernels, FX graphs) lives in a per-user cache folder,
$XDG_CACHE_HOME/meshrun/inductor (else ~/.cache/meshrun/inductor), unless TORCHINDUCTOR_CACHE_DIR
is set (launcher/torchrun.py sets it for the workers): every rank of the node and every restart or rerun of the same model reuses it (its writes
are atomic renames), where the run directory would start cold on every new run and often sits on
a network filesystem that many small files slow down; torch's own default (/tmp) does not survive
a container or a reboot.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshrun.errors import RunError
from meshrun.launcher import progress
from meshrun.launcher.torchrun import inductor_cache


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """`auto`: on CUDA, where compiling pays (torchtitan: +16% tokens/s for Llama 8B on H100); off
    on CPU, where compiling takes longer than a short job's whole training (the default job's 4
    blocks: ~15 s per rank on 2 shared cores, cold cache) and inductor needs a C++ compiler."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def inductor_cache_dir() -> str:
    """Where inductor caches (the launcher set it for its workers; a lone process sets it here,
    before its first compilation)."""
    return inductor_cache(os.environ)


def compile_failures() -> tuple[type[BaseException], ...]:
    """What torch raises when a graph cannot be captured or compiled (nothing of the block has run
    then). torch._dynamo.exc is private: this is its one use (tests/parallel/test_compile.py fails
    loudly if it moves)."""
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)


def keep_saved_buffers() -> None:
    """Let a compiled block's backward run with retain_graph, as the schedules that split the backward
    (zero-bubble, zbv: inputs first, weights later) run it; AOTAutograd's donated buffers (freed in
    the backward) refuse that. torch._functorch.config is private: this is its one use
    (tests/parallel/test_compile.py fails loudly if the flag goes)."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False


class CompiledForward:
    """A block's forward, compiled; its first call marks the progress as compilation. A compile
    failure stops the run (`strict`) or turns this block to eager after one warning."""

    def __init__(self, key: str, eager: Callable[..., Any], *, strict: bool, warn: Callable[[str], None]) -> None:
        self.key, self.eager, self.strict, self.warn = key, eager, strict, warn
        self.compiled: Callable[..., Any] | None = torch.compile(eager, fullgraph=True)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        self.calls += 1
        if self.calls == 1:
            progress.mark("compile", f"block {self.key}: torch.compile, first call (the first step compiles)")
        try:
            return self.compiled(*args, **kwargs)
        except compile_failures() as exc:
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            if self.strict:
                raise RunError(
                    f"train.compile: block {self.key} cannot compile ({reason}); "
                    "set train.compile: auto to run such blocks eager, or false"
                ) from None
            self.warn(f"warning: block {self.key} runs eager, torch.compile failed: {reason}")
            self.compiled = None
            return self.eager(*args, **kwargs)


def apply_compile(
    blocks: nn.ModuleDict, *, strict: bool, warn: Callable[[str], None], split_backward: bool = False
) -> None:
    """Compile each block's forward in place (parameter names and hooks unchanged); `split_backward`:
    a pipeline schedule runs the backward in two passes (see keep_saved_buffers)."""
    inductor_cache_dir()
    if split_backward:
        keep_saved_buffers()
    for key, block in blocks.items():
        block.forward = CompiledForward(key, block.forward, strict=strict, warn=warn)


def is_compiled(blocks: nn.ModuleDict) -> bool:
    return any(isinstance(block.forward, CompiledForward) for block in blocks.values())
