"""Stop and save requests, agreed on by every rank at a step boundary.

SIGTERM (what schedulers and torchrun send before killing) and SIGUSR1 (Slurm's
`--signal=USR1@T` warning) ask the job to checkpoint and exit; creating the file
`<run_dir>/SAVE` asks for a checkpoint without stopping. A signal may reach only one rank, so
the flags are all-reduced (MAX) every step: all ranks act on the same step.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped early with a checkpoint; rerun to resume


class Requests:
    def __init__(self, run_dir: Path, device: torch.device, *, is_rank0: bool) -> None:
        self.save_file, self.device, self.is_rank0 = run_dir / "SAVE", device, is_rank0
        self.signalled = False
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = True

    def poll(self) -> tuple[bool, bool]:
        """Collective: (save now, stop after saving), the same on every rank."""
        flags = torch.tensor([self.is_rank0 and self.save_file.exists(), self.signalled], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        save, stop = (bool(v) for v in flags.tolist())
        if save and self.is_rank0:
            self.save_file.unlink(missing_ok=True)
        return save or stop, stop

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
