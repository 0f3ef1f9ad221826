"""Mixture-of-Experts on CPU: per-rank training state at ep2 vs ep1, step time ep2 vs dp2 at ep1 and the
share of an ep2 step in its all-to-alls, the experts' throughput grouped (torch.nn.functional.grouped_mm)
vs a loop over the experts, and the planner's ep memory against a real step.

Both sides are two gloo ranks (torch.multiprocessing) training the built-in MoE GPT with meshrun's own
`parallelize` (DDP for the dense weights, parallel/experts.py's split and all-to-alls at ep 2), the
trainer's gradient sync and AdamW, on one batch: dp2 at ep1 (every rank all the experts) and dp2 at ep2
(each rank half of them). The sides take turns (A B, then B A, ...) for `--rounds` rounds of `--steps`
timed steps after one untimed; the verdict is the median of the per-round medians' ratios.

- state: params + grads + AdamW state each rank holds after a step (its local tensors); the experts'
  share of the model printed (the dense share stays whole on every rank);
- all-to-alls: the profiler's union of the all-to-all ops (and their waits) over one ep2 step on rank 0;
  on gloo these are loopback copies: printed so a GPU run can compare, no target;
- grouped vs loop: one MoE layer's experts forward + backward in one process, models/moe.py's code with
  the grouped matmul allowed or not (`grouped_mm_fits`), alternating, medians;
- planner: `layout_memory` (state + saved activations, balanced routing) over the measured state + the
  peak bytes saved for backward (planner/saved_bytes.py's counter), worst rank (target within 10%).

    python bench/moe.py                 # ~1-2 minutes on 2 busy cores
    python bench/moe.py --rounds 5
    python bench/moe.py --quick         # seconds: tiny model, one round
"""

from __future__ import annotations

import argparse
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
from meshrun.hardware.precision import autocast
from meshrun.models import moe
from meshrun.parallel.fsdp import measured_state_bytes
from meshrun.parallel.mesh import mesh_on
from meshrun.parallel.parallelize import parallelize
from meshrun.planner.layout_memory import layout_memory
from meshrun.planner.saved_bytes import SavedBytes
from meshrun.training.loss import MicrobatchLoss
from meshrun.training.optim import build_optimizer

STATE_TARGET = 0.55  # ep2 / ep1 per-rank state, for a model whose experts dominate
PLAN_TARGET = 0.10  # the planner's ep2 memory within this of measured
ALL_TO_ALL = ("alltoall", "all_to_all", "wait_tensor")  # gloo's op, the functional one, its wait


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (the verdict is their median ratio)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per side and round (after one untimed)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-dim", type=int, default=512, help="experts dominate: E x 3 x dim x expert_dim a layer")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="samples per step (each rank half)")
    p.add_argument("--rows", type=int, default=4096, help="grouped vs loop: rows (tokens x top_k) through 16 experts")
    tiny = {"rounds": 1, "steps": 1, "layers": 1, "dim": 16, "experts": 4, "expert_dim": 32, "seq_len": 8}
    return _quick.parse(p, {**tiny, "batch": 4, "rows": 64})


def job(args: argparse.Namespace, ep: int) -> Config:
    values = {
        "model.num_layers": args.layers,
        "model.dim": args.dim,
        "model.num_heads": 4 if args.dim % 4 == 0 else 1,
        "model.vocab_size": 256,
        "model.seq_len": args.seq_len,
        "model.dropout": 0.0,
        "model.moe.num_experts": args.experts,
        "model.moe.top_k": 2,
        "model.moe.expert_dim": args.expert_dim,
        "train.global_batch": args.batch,
        "train.micro_batch": args.batch // 2,
        "precision": "fp32",
        "recompute": "none",
        "parallel.dp": 2,
        "parallel.pp": 1,
        "parallel.ep": ep,
    }
    return load_config(None, [f"{k}={v}" for k, v in values.items()])


class Side:
    """One layout on this rank: its model, optimizer, a fixed batch, and a training step."""

    def __init__(self, cfg: Config) -> None:
        torch.manual_seed(0)
        self.cfg, self.mesh = cfg, mesh_on(cfg.layout, torch.device("cpu"))
        self.model = parallelize(cfg, self.mesh, loss=MicrobatchLoss(1), amp=lambda: autocast(cfg, self.mesh.device))
        self.optimizers = [build_optimizer(part, cfg.train) for part in self.model.parts]
        self.params = [p for part in self.model.parts for p in part.parameters()]
        tokens = torch.randint(0, 256, (cfg.train.micro_batch, cfg.model.seq_len + 1), generator=torch.Generator())
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]

    def step(self) -> float:
        dist.barrier()
        start = time.perf_counter()
        self.model.forward_backward(self.inputs, self.targets)
        self.model.experts.sync_gradients()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # the state measured after a step holds gradients
        return time.perf_counter() - start

    def state(self) -> dict[str, int]:
        """Bytes this rank holds: all its training state, and its experts' (params, grads, AdamW)."""
        experts = [p for part in self.model.parts for name, p in part.named_parameters() if ".experts." in name]
        moments = [o.state[p] for o in self.optimizers for p in experts if p in o.state]
        return {
            "state": measured_state_bytes(self.params, self.optimizers)[0],
            "experts": sum(p.nbytes + p.grad.nbytes for p in experts if p.grad is not None)
            + sum(t.nbytes for state in moments for t in state.values() if isinstance(t, torch.Tensor)),
        }

    def saved_peak(self) -> int:
        """Peak bytes autograd keeps for backward in one step (planner/saved_bytes.py's counter)."""
        counter = SavedBytes(exclude=self.params)
        counter.reset_peak()
        start = counter.live
        with counter.hooks():
            self.model.forward_backward(self.inputs, self.targets)
        self.model.experts.sync_gradients()
        return counter.peak - start

    def all_to_all_share(self) -> float:
        """Union of the all-to-all ops over one step's span (CPU events of the profiler)."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            self.step()
        events = [(e.time_range.start, e.time_range.end, e.name.lower()) for e in prof.events()]
        span = max(end for _, end, _ in events) - min(start for start, _, _ in events)
        busy, last = 0.0, float("-inf")
        for start, end, _ in sorted(e for e in events if any(n in e[2] for n in ALL_TO_ALL)):
            if end > last:
                busy += end - max(start, last)
                last = end
        return busy / span


def worker(rank: int, args: argparse.Namespace, store_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", 2), rank=rank, world_size=2)
    try:
        sides = {ep: Side(job(args, ep)) for ep in (1, 2)}
        for side in sides.values():
            side.step()  # untimed: first-step allocations
        times: dict[int, list[float]] = {1: [], 2: []}
        for round_ in range(args.rounds):
            for ep in (1, 2) if round_ % 2 == 0 else (2, 1):
                times[ep].append(statistics.median(sides[ep].step() for _ in range(args.steps)))
        result = {
            "times": times,
            **{f"ep{ep}": side.state() for ep, side in sides.items()},
            "saved": sides[2].saved_peak(),
            "share": sides[2].all_to_all_share(),
        }
        Path(store_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def grouped_vs_loop(args: argparse.Namespace) -> list[float]:
    """Per round, the loop's forward + backward time over the grouped one (models/moe.py's Experts)."""
    torch.manual_seed(0)
    experts = moe.Experts(num_experts=16, dim=args.dim, expert_dim=args.expert_dim)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.02)
    x = torch.randn(args.rows // 2, args.dim, requires_grad=True)
    index = torch.randint(0, 16, (args.rows // 2, 2))
    weights = torch.full((args.rows // 2, 2), 0.5)
    fits = moe.grouped_mm_fits

    def timed(grouped: bool) -> float:
        moe.grouped_mm_fits = fits if grouped else (lambda *_: False)  # the loop where grouped_mm is refused
        try:
            start = time.perf_counter()
            for _ in range(args.steps):
                experts(x, index, weights).sum().backward()
            return time.perf_counter() - start
        finally:
            moe.grouped_mm_fits = fits

    timed(True), timed(False)  # warm-up
    ratios = []
    for round_ in range(max(3, args.rounds)):
        order = (True, False) if round_ % 2 == 0 else (False, True)
        seconds = dict(zip(order, (timed(g) for g in order)))
        ratios.append(seconds[False] / seconds[True])
    return ratios


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, tmp), nprocs=2)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    ratios = [b / a for a, b in zip(ranks[0]["times"]["1"], ranks[0]["times"]["2"])]
    for i, (a, b) in enumerate(zip(ranks[0]["times"]["1"], ranks[0]["times"]["2"])):
        print(f"round {i + 1}: dp2 ep1 {a * 1e3:8.1f} ms/step, dp2 ep2 {b * 1e3:8.1f} ms/step", flush=True)
    one, two = (max(r[f"ep{ep}"]["state"] for r in ranks) for ep in (1, 2))
    experts_one = ranks[0]["ep1"]["experts"]
    print(f"\ndense share of the training state: {1 - experts_one / one:.1%} (whole on every rank)")
    print(f"per-rank expert state ep2 / ep1: {max(r['ep2']['experts'] for r in ranks) / experts_one:.3f}")
    state = two / one
    print(f"per-rank state ep2 / ep1: {state:.3f} (target <= {STATE_TARGET})")
    planned = layout_memory(job(args, 2), "fp32").ranks[0]
    plan = max(
        (planned.params + planned.grads + planned.optimizer + planned.activations) / (r["ep2"]["state"] + r["saved"])
        for r in ranks
    )
    print(
        f"planner / measured ep2 memory (state + saved activations), worst rank: {plan:.3f} (target within {PLAN_TARGET:.0%})"
    )
    print(
        f"step time ep2 / dp2 at ep1: median {statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(f"all-to-alls' share of an ep2 step (rank 0, gloo): {ranks[0]['share']:.0%}")
    loop = grouped_vs_loop(args)
    print(
        f"experts forward + backward, loop / grouped time: median {statistics.median(loop):.2f}x (16 experts, {args.rows} rows)"
    )
    passed = state <= STATE_TARGET and abs(plan - 1) <= PLAN_TARGET
    print(f"{'PASS' if passed else 'FAIL'}: ep2 / ep1 state {state:.3f}, planner / measured {plan:.3f}")
    sys.exit(_quick.exit_code(passed, quick=args.quick))


if __name__ == "__main__":
    main()
