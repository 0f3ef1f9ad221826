"""The hand-written side of bench/pipeline.py: a minimal torch.distributed.pipelining loop.

    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/_handwritten_pipeline.py \
        --data DIR --out DIR --microbatches 8

The same model as meshrun (meshrun.models.gpt.GPT built on meta, this stage's blocks kept,
to_empty, init_weights), the same even split, Schedule1F1B, AdamW (decay on matrices only),
global-norm clipping over the stages, fp32. Writes each rank's step times to OUT/rank{R}.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from meshrun.config.model_sections import GPTSection
from meshrun.models.gpt import GPT
from meshrun.parallel.stages import even_split


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="folder for the per-rank JSON results")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    cfg = GPTSection(num_layers=args.layers, dim=args.dim, num_heads=args.heads, seq_len=args.seq_len)
    with torch.device("meta"):
        model = GPT(cfg)
    keep = {str(i) for i in even_split(args.layers, world)[rank]}
    for key in [k for k in model.blocks if k not in keep]:
        del model.blocks[key]
    first, last = rank == 0, rank == world - 1
    if not first:
        model.embed = None
    if not last:
        model.norm = model.head = None
    model.to_empty(device=device)
    model.init_weights(1337)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # the schedule divides grads by m

    stage = PipelineStage(model, rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    params = list(model.parameters())
    groups = [
        {"params": [q for q in params if q.ndim >= 2], "weight_decay": 0.1},
        {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))

    shard = json.loads(Path(args.data, "meta.json").read_text())["splits"]["train"]["shards"][0]["file"]
    tokens = np.memmap(Path(args.data, shard), dtype=np.uint8, mode="r")  # byte-level: the stdlib fits one shard
    rng = np.random.default_rng(0)
    batch = args.micro_batch * args.microbatches
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        starts = rng.integers(0, len(tokens) - args.seq_len - 1, batch)
        window = torch.from_numpy(np.stack([tokens[s : s + args.seq_len + 1] for s in starts]).astype(np.int64))
        x, y = window[:, :-1], window[:, 1:]
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        norm_sq = torch.nn.utils.get_total_norm([q.grad for q in params if q.grad is not None]) ** 2
        dist.all_reduce(norm_sq)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm_sq.sqrt())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "step_times": times}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
