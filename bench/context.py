"""Context parallel (`parallel.cp`, Ulysses all-to-alls) on CPU: peak activation memory per rank at
cp2 vs cp1, the longest sequence each trains under a memory cap, step time and its share in the
all-to-alls.

Each side is meshrun's own stage building (`parallelize`: the two all-to-alls around every
attention, DDP over dp x cp) and AdamW on a real gloo group, one process for cp1 and two for cp2,
on the same batch of the built-in GPT (fp32, no recompute, each rank its T / cp positions:
`shard_batch`). Per rank:

- activations: the peak bytes autograd keeps for backward over one step (saved-tensor hooks, the
  planner's count: planner/saved_bytes.py), and the planner's prediction of them;
- step time: the median over the timed steps (after a warm-up step), and on the last the profiler's
  all-to-all time over the step's (gloo: copies through loopback, printed, no target);
- longest sequence: the planner's prediction (its per-rank memory, layout_memory: state, buffers,
  activations and backward) searched for the longest seq_len (a multiple of `--granule`) under
  `--cap-gb` per rank, at cp1 and cp2. Not a run at that length: the prediction is validated by
  the measured point above (its activations within the printed ratio of what the step kept).

Targets (issue 45): peak activations per rank cp2 / cp1 <= 0.6x; longest trainable sequence
cp2 / cp1 >= 1.8x.

    python bench/context.py                 # ~1 minute on 2 busy cores: seq 2048, 4 timed steps
    python bench/context.py --seq-len 4096 --cap-gb 8
    python bench/context.py --quick         # seconds: seq 64, a 1-layer d16 model, 2 steps
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
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048, help="the measured length (fits one rank)")
    p.add_argument("--steps", type=int, default=5, help="steps per side (the first is not timed)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="samples per step (one microbatch)")
    p.add_argument("--cap-gb", type=float, default=16.0, help="memory per rank for the longest-sequence search")
    p.add_argument("--granule", type=int, default=256, help="seq_len searched in multiples of this")
    tiny = {"seq_len": 64, "steps": 2, "layers": 1, "dim": 16, "heads": 2, "vocab": 64, "cap_gb": 0.01, "granule": 64}
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


def measure(cfg: Config, steps: int) -> dict[str, float]:
    """On this rank of a process group of cp ranks: the step's peak saved bytes (second step), the
    timed steps' median and the last step's all-to-all seconds (profiler)."""
    mesh = mesh_on(cfg.layout, torch.device("cpu"))
    torch.manual_seed(0)
    model = parallelize(cfg, mesh, loss=MicrobatchLoss(1), amp=contextlib.nullcontext)
    optimizers = [build_optimizer(part, cfg.train) for part in model.parts]
    counter = SavedBytes(exclude=[p for part in model.parts for p in part.parameters()])
    x, y = shard_batch(*task_io(cfg).batch(cfg.train.global_batch, torch.Generator().manual_seed(1)), mesh)
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


def all_to_all_s(profiler: torch.profiler.profile) -> float:
    """Seconds in all-to-alls: the largest total among the profiler's events named so (the c10d op
    and gloo's own nest: the outermost holds the others)."""
    totals = [e.cpu_time_total for e in profiler.key_averages() if "all_to_all" in e.key or "alltoall" in e.key]
    return max(totals, default=0.0) / 1e6


def worker(rank: int, world: int, folder: str, argv: list[str], seq_len: int) -> None:
    """torch.multiprocessing target: one side (cp = world) on this rank, to FOLDER/rank{R}.json."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / f"store{world}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        args = parse_args(argv)
        result = measure(job(args, seq_len=seq_len, cp=world), args.steps)
        (Path(folder) / f"cp{world}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def side(folder: str, argv: list[str], seq_len: int, cp: int) -> list[dict[str, float]]:
    """Every rank's result of one side: cp1 in this process (a group of one), cp2 spawned."""
    if cp == 1:
        worker(0, 1, folder, argv, seq_len)
    else:
        mp.spawn(worker, args=(cp, folder, argv, seq_len), nprocs=cp)
    return [json.loads((Path(folder) / f"cp{cp}-rank{r}.json").read_text()) for r in range(cp)]


def longest(args: argparse.Namespace, cp: int) -> int:
    """The longest multiple of `--granule` (and of cp) whose predicted per-rank memory fits the cap."""
    cap, step = args.cap_gb * GIB, args.granule * cp

    def fits(n: int) -> bool:
        return layout_memory(job(args, seq_len=n, cp=cp), "fp32").peak <= cap

    if not fits(step):
        return 0
    lo, hi = 1, 2
    while fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"context parallel: gpt {args.layers} x d{args.dim}, {args.heads} heads, batch {args.batch}, fp32, gloo")
    with tempfile.TemporaryDirectory() as folder:
        one = side(folder, argv, args.seq_len, 1)[0]
        two = side(folder, argv, args.seq_len, 2)
    planned = {cp: layout_memory(job(args, seq_len=args.seq_len, cp=cp), "fp32").ranks[0].activations for cp in (1, 2)}
    worst = max(r["activations"] for r in two)
    ratio = worst / one["activations"]
    for cp, measured in ((1, one["activations"]), (2, worst)):
        print(
            f"seq {args.seq_len} cp{cp}: activations per rank {measured / 2**20:.3f} MiB measured, "
            f"{planned[cp] / 2**20:.3f} MiB planned ({planned[cp] / measured:.3f}x)"
        )
    step2 = max(r["step_s"] for r in two)
    share = max(r["all_to_all_s"] / r["last_s"] for r in two)
    print(f"step time cp2 / cp1: {step2:.4f} s / {one['step_s']:.4f} s = {step2 / one['step_s']:.2f}x")
    print(f"all-to-all share of a cp2 step (profiler, last step, worst rank): {share:.1%} (gloo on CPU: no target)")
    lengths = {cp: longest(args, cp) for cp in (1, 2)}
    grown = lengths[2] / lengths[1] if lengths[1] else float("nan")
    print(
        f"longest trainable seq_len under {args.cap_gb:g} GiB per rank (planner's prediction): "
        f"cp1 {lengths[1]}, cp2 {lengths[2]} = {grown:.2f}x"
    )
    memory_ok, length_ok = ratio <= ACTIVATIONS_TARGET, grown >= LENGTH_TARGET
    print(
        f"{'PASS' if memory_ok else 'FAIL'}: peak activations per rank cp2 / cp1 {ratio:.3f}x (<= {ACTIVATIONS_TARGET})"
    )
    print(f"{'PASS' if length_ok else 'FAIL'}: longest sequence cp2 / cp1 {grown:.2f}x (>= {LENGTH_TARGET})")
    return _quick.exit_code(memory_ok and length_ok, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
