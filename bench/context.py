"""Context parallel (`parallel.cp`, Ulysses all-to-alls) on CPU: peak activation memory per rank at
cp2 vs cp1, the longest sequence each trains under a memory cap, step time and its share in the
all-to-alls.

Each side is meshrun's own stage building (`parallelize`: the two all-to-alls around every
attention, DDP over dp x cp) and AdamW on a real gloo group, one process for cp1 and two for cp2,
on the same batch of the built-in GPT (fp32, no recompute, each rank its T / cp positions:
`shard_batch`). Per rank:

- activations: the peak bytes autograd keeps for backward over one step (saved-tensor hooks, the
  planner's count: planner/saved_bytes.py) at cp1's longest seq_len (`--seq-len`: another), and
  the planner's prediction of them;
- step time: the median over the timed steps (after a warm-up step), and on the last the profiler's
  all-to-all time over the step's (gloo: copies through loopback, printed, no target);
- longest sequence: found by real training steps. Under `--budget-mib` per rank, the longest
  seq_len (a multiple of `--granule`, which cp divides) whose step's per-rank peak fits, at cp1
  and at cp2: doubling from one granule until a step does not fit, then bisection. A step's peak
  is counted as the plan counts it: parameters, gradients and AdamW state (the tensors after the
  step), DDP's gradient buckets (its own record of them), and the peak bytes autograd keeps for
  backward (the saved-tensor hooks above), the largest over the cp ranks. The plan's longest
  under the same budget is printed beside it.

Why a budget of megabytes stands in for a device's gigabytes: every term of a rank's peak is a
constant (the weights and their state, whole on each cp rank; cp2's DDP buckets) or grows linearly
with seq_len (activations, / cp; the learned position table, whole), so the longest length grows
with the budget and the cp2 / cp1 ratio tends to the ratio of the bytes per position once the
constants are a small part of the budget, as in a device's gigabytes. The defaults keep them so
(a small model, a batch of 8: 7% of 64 MiB), the lengths long enough that one granule is a small
error (> 50 granules) and each step under a second or so.
Transients outside autograd's saved tensors (a matmul's output before it is saved, the
optimizer's temporaries) are not counted, on either side.

Targets (issue 45): peak activations per rank cp2 / cp1 <= 0.6x; longest trainable sequence
cp2 / cp1 >= 1.8x.

    python bench/context.py                 # ~2 minutes on 2 busy cores: the searches, 4 timed steps
    python bench/context.py --budget-mib 32 --steps 2
    python bench/context.py --quick         # seconds: a 1-layer d16 model under 0.25 MiB, 2 steps
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _quick  # bench/ is the script's folder: on sys.path
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from meshrun.config.schema import Config, load_config
from meshrun.models.task_io import task_io
from meshrun.parallel.context import shard_batch
from meshrun.parallel.mesh import mesh_on
from meshrun.parallel.parallelize import parallelize
from meshrun.planner.layout_memory import layout_memory
from meshrun.planner.saved_bytes import SavedBytes
from meshrun.training.loss import MicrobatchLoss
from meshrun.training.optim import build_optimizer

ACTIVATIONS_TARGET = 0.6  # cp2 / cp1 peak activations per rank, at most
LENGTH_TARGET = 1.8  # cp2 / cp1 longest trainable sequence, at least
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=None, help="the timed length (default: cp1's longest)")
    p.add_argument("--steps", type=int, default=5, help="steps per side (the first is not timed)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="samples per step (one microbatch)")
    p.add_argument("--budget-mib", type=float, default=64.0, help="memory per rank for the longest-sequence search")
    p.add_argument("--granule", type=int, default=8, help="seq_len searched in multiples of this (cp divides it)")
    tiny = {"steps": 2, "batch": 2, "layers": 1, "dim": 16, "heads": 2, "vocab": 64, "budget_mib": 0.25, "granule": 32}
    return _quick.parse(p, tiny, argv)


def job(args: argparse.Namespace, *, seq_len: int, cp: int) -> Config:
    return load_config(
        None,
        [
            f"model.num_layers={args.layers}",
            f"model.dim={args.dim}",
            f"model.num_heads={args.heads}",
            f"model.vocab_size={args.vocab}",
            f"model.seq_len={seq_len}",
            "model.dropout=0.0",
            "precision=fp32",
            "recompute=none",
            "train.compile=false",
            f"train.global_batch={args.batch}",
            f"train.micro_batch={args.batch}",
            "parallel.dp=1",
            "parallel.pp=1",
            f"parallel.cp={cp}",
        ],
    )


def built(cfg: Config) -> tuple[Any, list[torch.optim.Optimizer], SavedBytes, torch.Tensor, torch.Tensor]:
    """On this rank of a process group of cp ranks: meshrun's model, its AdamW, a saved-bytes
    counter (parameters left out) and this rank's part of the batch."""
    mesh = mesh_on(cfg.layout, torch.device("cpu"))
    torch.manual_seed(0)
    model = parallelize(cfg, mesh, loss=MicrobatchLoss(1), amp=contextlib.nullcontext)
    optimizers = [build_optimizer(part, cfg.train) for part in model.parts]
    counter = SavedBytes(exclude=[p for part in model.parts for p in part.parameters()])
    x, y = shard_batch(*task_io(cfg).batch(cfg.train.global_batch, torch.Generator().manual_seed(1)), mesh)
    return model, optimizers, counter, x, y


def measure(cfg: Config, steps: int) -> dict[str, float]:
    """The step's peak saved bytes (second step), the timed steps' median and the last step's
    all-to-all seconds (profiler)."""
    model, optimizers, counter, x, y = built(cfg)
    times, peak, exchange = [], 0, 0.0
    for step in range(steps):
        gc.collect()
        counter.reset_peak()
        start = counter.live
        profiling = step == steps - 1
        hooks = counter.hooks() if step == 1 or steps == 1 else contextlib.nullcontext()
        profiler = torch.profiler.profile() if profiling else contextlib.nullcontext()
        dist.barrier()
        began = time.perf_counter()
        with profiler, hooks:
            model.forward_backward(x, y)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - began)
        peak = max(peak, counter.peak - start)
        if isinstance(profiler, torch.profiler.profile):
            exchange = all_to_all_s(profiler)
    timed = times[1:] or times
    return {"activations": peak, "step_s": statistics.median(timed), "all_to_all_s": exchange, "last_s": times[-1]}


def step_peak(cfg: Config) -> int:
    """One real training step at cfg's seq_len: the most bytes any cp rank held (the module
    docstring's count), agreed by every rank."""
    model, optimizers, counter, x, y = built(cfg)
    with counter.hooks():
        model.forward_backward(x, y)
    for optimizer in optimizers:
        optimizer.step()
    held = [p for part in model.parts for p in part.parameters()]
    held += [p.grad for p in held if p.grad is not None]
    held += [t for o in optimizers for state in o.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    wrapped = model.wrapped
    buckets = wrapped._get_ddp_logging_data()["bucket_sizes"] if isinstance(wrapped, DistributedDataParallel) else ""
    peak = torch.tensor(counter.peak + sum(t.nbytes for t in held) + sum(int(b) for b in str(buckets).split(",") if b))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def longest(fits: Callable[[int], bool], granule: int) -> int:
    """The longest multiple of `granule` that `fits` (0: not even one): doubling, then bisection."""
    if not fits(granule):
        return 0
    lo, hi = 1, 2
    while fits(hi * granule):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * granule) else (lo, mid)
    return lo * granule


def measured_longest(args: argparse.Namespace, cp: int) -> int:
    """The longest seq_len whose real step fits `--budget-mib` on every rank, at this cp."""
    budget = args.budget_mib * MIB
    return longest(lambda n: step_peak(job(args, seq_len=n, cp=cp)) <= budget, args.granule)


def planned_longest(args: argparse.Namespace, cp: int) -> int:
    """The same search over the plan's per-rank peak (layout_memory: state, buffers, activations,
    the loss's backward)."""
    budget = args.budget_mib * MIB
    return longest(lambda n: layout_memory(job(args, seq_len=n, cp=cp), "fp32").peak <= budget, args.granule)


def all_to_all_s(profiler: torch.profiler.profile) -> float:
    """Seconds in all-to-alls: the largest total among the profiler's events named so (the c10d op
    and gloo's own nest: the outermost holds the others)."""
    totals = [e.cpu_time_total for e in profiler.key_averages() if "all_to_all" in e.key or "alltoall" in e.key]
    return max(totals, default=0.0) / 1e6


def worker(rank: int, world: int, folder: str, argv: list[str], seq_len: int | None) -> None:
    """torch.multiprocessing target: one side (cp = world) on this rank, to FOLDER/rank{R}.json: its
    longest seq_len under the budget, then the timed steps at `seq_len` (None: that longest)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / f"store{world}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        args = parse_args(argv)
        found = measured_longest(args, world)
        if not (seq_len or found):
            raise SystemExit(f"--budget-mib {args.budget_mib:g} holds no step of {args.granule} tokens at cp{world}")
        at = seq_len or found
        result = {**measure(job(args, seq_len=at, cp=world), args.steps), "longest": found, "seq_len": at}
        (Path(folder) / f"cp{world}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def side(folder: str, argv: list[str], seq_len: int | None, cp: int) -> list[dict[str, float]]:
    """Every rank's result of one side: cp1 in this process (a group of one), cp2 spawned."""
    if cp == 1:
        worker(0, 1, folder, argv, seq_len)
    else:
        mp.spawn(worker, args=(cp, folder, argv, seq_len), nprocs=cp)
    return [json.loads((Path(folder) / f"cp{cp}-rank{r}.json").read_text()) for r in range(cp)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"context parallel: gpt {args.layers} x d{args.dim}, {args.heads} heads, batch {args.batch}, fp32, gloo")
    with tempfile.TemporaryDirectory() as folder:
        one = side(folder, argv, args.seq_len, 1)[0]
        seq_len = int(one["seq_len"])  # cp1's longest, unless --seq-len: cp2 runs the same length
        two = side(folder, argv, seq_len, 2)
    lengths = {1: int(one["longest"]), 2: int(two[0]["longest"])}
    grown = lengths[2] / lengths[1]
    plan = {cp: planned_longest(args, cp) for cp in (1, 2)}
    print(
        f"longest trainable seq_len under {args.budget_mib:g} MiB per rank, measured by real steps: "
        f"cp1 {lengths[1]}, cp2 {lengths[2]} = {grown:.2f}x "
        f"(the plan's: cp1 {plan[1]}, cp2 {plan[2]} = {plan[2] / plan[1] if plan[1] else float('nan'):.2f}x)"
    )
    planned = {cp: layout_memory(job(args, seq_len=seq_len, cp=cp), "fp32").ranks[0].activations for cp in (1, 2)}
    worst = max(r["activations"] for r in two)
    ratio = worst / one["activations"]
    for cp, measured in ((1, one["activations"]), (2, worst)):
        print(
            f"seq {seq_len} cp{cp}: activations per rank {measured / MIB:.3f} MiB measured, "
            f"{planned[cp] / MIB:.3f} MiB planned ({planned[cp] / measured:.3f}x)"
        )
    step2 = max(r["step_s"] for r in two)
    share = max(r["all_to_all_s"] / r["last_s"] for r in two)
    print(f"step time cp2 / cp1: {step2:.4f} s / {one['step_s']:.4f} s = {step2 / one['step_s']:.2f}x")
    print(f"all-to-all share of a cp2 step (profiler, last step, worst rank): {share:.1%} (gloo on CPU: no target)")
    memory_ok, length_ok = ratio <= ACTIVATIONS_TARGET, grown >= LENGTH_TARGET
    print(
        f"{'PASS' if memory_ok else 'FAIL'}: peak activations per rank cp2 / cp1 {ratio:.3f}x (<= {ACTIVATIONS_TARGET})"
    )
    print(f"{'PASS' if length_ok else 'FAIL'}: longest sequence cp2 / cp1 {grown:.2f}x (>= {LENGTH_TARGET})")
    return _quick.exit_code(memory_ok and length_ok, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
