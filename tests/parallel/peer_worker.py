"""A dp2 DDP worker that survives a lost peer (tests/parallel/test_regroup.py): a small model
trained with AdamW on batches that are a function of (step, rank), under meshrun.launcher.keeper,
joining the job's store at MASTER_ADDR:MASTER_PORT (hosted by the test). With
MESHRUN_TEST_KILL="RANK:STEP" that rank SIGKILLs itself in its first generation just before the
backward of STEP, while its peer waits in the backward's all-reduce; the survivor rebuilds the group
with the replacement, which takes every weight and optimizer moment from it, and both retrain the
step that was in flight. Writes OUT/steps-RANK.jsonl (a row per step trained, a row per recovery)
and OUT/final-RANK.pt (the weights)."""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshrun.launcher.keeper import GENERATION_ENV
from meshrun.parallel import regroup

STEPS = 6
TIMEOUT = timedelta(seconds=60)  # a hung peer's bound; a killed one is noticed at once


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at `step`: a replacement reads the one its predecessor would have."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, step: torch.Tensor) -> list[torch.Tensor]:
    """Everything a replica holds, in one order on every rank: the step, the weights, AdamW's moments
    (made here, as zeros, where no step has made them yet: a replacement's)."""
    tensors = [step]
    for param in model.parameters():
        state = optimizer.state[param]
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        tensors += [param.data, state["step"], state["exp_avg"], state["exp_avg_sq"]]
    return tensors


def killed_here(rank: int, step: int) -> bool:
    kill = os.environ.get("MESHRUN_TEST_KILL")
    return kill == f"{rank}:{step}" and regroup.generation() == 0


def main(out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    first = os.environ.get(GENERATION_ENV, "0") == "0"
    torch.manual_seed(0 if first else 1)  # a replacement's own initial weights differ: the copy must replace them
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    number = regroup.generation()  # a spare waits here, built, for its turn
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=TIMEOUT)
    step = torch.zeros((), dtype=torch.int64)
    log = (out / f"steps-{rank}.jsonl").open("a")
    if number == 0:
        regroup.join(store, number=0, rank=rank, world=world, timeout=TIMEOUT)
    else:  # a replacement: the survivors' state, then the step that was in flight
        source, seconds = regroup.recover(
            store,
            state_tensors(model, optimizer, step),
            number=number,
            rank=rank,
            world=world,
            timeout=TIMEOUT,
            holds=False,
        )
        log.write(json.dumps({"recovered": int(step), "source": source, "seconds": seconds}) + "\n")
    ddp = DistributedDataParallel(model, init_sync=False)  # the state is already the replicas'
    while int(step) < STEPS:
        x, y = batch(int(step), rank)
        try:
            loss = nn.functional.mse_loss(ddp(x), y)
            if killed_here(rank, int(step)):
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
        except RuntimeError as broken:
            if not regroup.lost_peer(broken):
                raise
            optimizer.zero_grad(set_to_none=True)  # half-reduced gradients: the step is trained again
            number += 1
            source, seconds = regroup.recover(
                store,
                state_tensors(model, optimizer, step),
                number=number,
                rank=rank,
                world=world,
                timeout=TIMEOUT,
                holds=True,
            )
            log.write(json.dumps({"recovered": int(step), "source": source, "seconds": seconds}) + "\n")
            ddp = DistributedDataParallel(model, init_sync=False)
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.write(json.dumps({"step": int(step), "loss": loss.item()}) + "\n")
        log.flush()
        step += 1
    torch.save(model.state_dict(), out / f"final-{rank}.pt")
    regroup.tear_down()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
