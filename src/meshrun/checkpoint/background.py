"""Asynchronous checkpoints (`checkpoint.async`): training waits only while the state is staged
(copied off the live tensors); DCP writes the copy in a thread of its own, and the main thread
publishes it (manifest, `latest`, retention: `dcp.publish`, as a synchronous save does) at a step
boundary once every rank's write completed. Until then the checkpoint is a `.tmp` folder, so a
crash mid-write leaves the previous checkpoint as `latest`.

At most one save is in flight: the next save, a synchronous one (preemption, the end of the run)
and the end of training wait for it first. DCP's background collectives run over a gloo group of
their own, apart from the training's; whether every rank's write is done is agreed over another,
from the main thread, so that every rank publishes (or fails) at the same step.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshrun.checkpoint.dcp import failed_save, publish, shard_sums, shard_writer, start_folder


@dataclass(frozen=True)
class _InFlight:
    tmp: Path  # the folder DCP writes into
    written: Future[dict[str, int]]  # this rank's shard checksums, once its write completed
    publishing: dict[str, Any]  # publish()'s keyword arguments: keep, config, protected, data_card, base


class BackgroundSaves:
    def __init__(self) -> None:
        """Collective: every rank constructs it at the same point."""
        self.writer_group = _gloo_group()  # DCP's collectives, from its thread
        self.agree_group = _gloo_group()  # the main thread's: is every write done?
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshrun-checkpoint-crc")
        self.in_flight: _InFlight | None = None

    def start(self, state: dict[str, torch.Tensor], run_dir: Path, step: int, **publishing: Any) -> Path:
        """Collective: stage `state` (what training waits for) and write it in the background;
        a save still in flight is finished first. Returns the folder it will be published as."""
        self.wait()
        tmp = start_folder(run_dir, step)
        try:
            writing = dcp.async_save(state, storage_writer=shard_writer(tmp), process_group=self.writer_group)
        except (OSError, RuntimeError, dcp.CheckpointException) as exc:  # staging ran out of memory
            raise failed_save(exc, tmp) from None
        assert isinstance(writing, Future)  # a blocking stager (DCP's file writer): the write's future
        self.in_flight = _InFlight(tmp, self.hasher.submit(_sums_once_written, writing, tmp), publishing)
        return _final(tmp)

    @property
    def writing(self) -> Path | None:
        """The folder the save in flight will be published as (None: no save in flight)."""
        return None if self.in_flight is None else _final(self.in_flight.tmp)

    def poll(self) -> Path | None:
        """Collective, once per step: publish the save in flight once every rank's write is done
        and return its folder (None: nothing published). A failed write raises here, as one line
        for a full disk."""
        if self.in_flight is None:
            return None
        done = torch.tensor([self.in_flight.written.done()], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.agree_group)
        return self._publish() if done.item() else None

    def wait(self) -> Path | None:
        """Collective: wait for the save in flight, if any, and publish it (returns its folder)."""
        if self.in_flight is None:
            return None
        concurrent.futures.wait([self.in_flight.written])
        return self._publish()

    def _publish(self) -> Path:
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        try:
            sums = flight.written.result()
        except (OSError, RuntimeError, dcp.CheckpointException) as exc:  # DCP's: on every rank alike
            raise failed_save(exc, flight.tmp) from None
        everyone: list[dict[str, int]] = [{}] * dist.get_world_size()
        dist.all_gather_object(everyone, sums)
        return publish(flight.tmp, everyone, **flight.publishing)

    def close(self) -> None:
        """Let the hashing thread go (a write still in flight after a failure is not waited for)."""
        self.hasher.shutdown(wait=False, cancel_futures=True)


def _sums_once_written(writing: Future, tmp: Path) -> dict[str, int]:
    """In the background: wait for DCP's write of this rank's shards, then hash them."""
    writing.result()
    return shard_sums(tmp)


def _final(tmp: Path) -> Path:
    return tmp.with_name(tmp.name.removesuffix(".tmp"))


def _gloo_group() -> dist.ProcessGroup:
    """A new group of every rank on gloo (CPU tensors: no device sync, on CUDA too)."""
    return cast(dist.ProcessGroup, dist.new_group(backend="gloo"))  # a ProcessGroup on every member rank
