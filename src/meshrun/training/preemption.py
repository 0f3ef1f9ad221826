"""Stop and save requests, agreed on by every rank at a step boundary.

SIGTERM (what schedulers and torchrun send before killing) and SIGUSR1 (Slurm's
`--signal=USR1@T` warning) ask the job to checkpoint and exit; creating the file
`<run_dir>/SAVE` asks for a checkpoint without stopping (something there that is not a file, such
as a folder, is ignored with one warning). A signal may reach only one rank, so
the flags are all-reduced (MAX): all ranks act on the same step.

The all-reduce runs on CPU tensors over a gloo group of its own and asynchronously: the flags
sent at the end of step N are read at the end of step N+1, so a request is honoured within one
step, and no step waits for the device (nor for the other ranks) to find out that nobody asked.
"""

from __future__ import annotations

import signal
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.files.console import say
from meshrun.launcher.outcome import STOP_SIGNALS
from meshrun.metrics import time_split


class Requests:
    def __init__(self, run_dir: Path, *, is_rank0: bool) -> None:
        """Collective when several ranks exist: every rank constructs it at the same point."""
        self.save_file, self.is_rank0 = run_dir / "SAVE", is_rank0
        self.signalled = self.warned = False
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.pending: tuple[dist.Work, torch.Tensor] | None = None
        self.carried = torch.zeros(2, dtype=torch.int32)  # flags a lost peer broke in flight: sent again

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = True

    def _local_flags(self) -> torch.Tensor:
        flags = torch.tensor([self.is_rank0 and self._save_requested(), self.signalled], dtype=torch.int32)
        flags, self.carried = torch.maximum(flags, self.carried), torch.zeros_like(self.carried)
        return flags

    def _save_requested(self) -> bool:
        """The SAVE file was there: it is removed, so the request counts once (the flag carries it)."""
        try:
            self.save_file.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:  # a folder (or a file this user cannot remove): no request, and no crash
            if not self.warned:
                say(f"warning: {self.save_file} is not a removable file ({exc.strerror}); not taken as a save request")
                self.warned = True
            return False

    def poll(self) -> tuple[bool, bool]:
        """Collective, once per step: (save now, stop after saving) as asked for up to the
        previous call, the same on every rank; sends this step's flags on their way."""
        flags = self._local_flags()
        if self.group is None:  # one process: nothing to agree on, act now
            save, stop = (bool(v) for v in flags.tolist())
            return save or stop, stop
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None  # async_op=True always returns the work handle
        previous, self.pending = self.pending, (work, flags)
        if previous is None:
            return False, False
        with time_split.section("wait"):  # for the previous step's flags of every rank: a straggler's come last
            previous[0].wait()
        save, stop = (bool(v) for v in previous[1].tolist())
        return save or stop, stop

    def leave(self) -> None:
        """Before a broken process group is destroyed (training/recovery.py): the flags' group and
        the all-reduce in flight on it dropped, so that its connections close (a peer blocked on
        them then notices the loss too); `regroup` makes them again. The flags in flight are sent
        again at the next poll (a SAVE file's request was taken when they were sent)."""
        if self.pending is not None:
            self.carried = torch.maximum(self.carried, self.pending[1])
        self.group, self.pending = None, None

    def regroup(self) -> None:
        """Collective, after a lost peer was replaced (training/recovery.py): the flags' group made
        again over the new process group; the flags in flight on the broken one go with the next poll."""
        self.group, self.pending = dist.new_group(backend="gloo"), None

    def close(self) -> None:
        if self.pending is not None:
            self.pending[0].wait()  # no collective left in flight when the process group goes
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
