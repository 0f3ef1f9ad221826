"""Worker for bench/pipeline.py: peak bytes saved for backward on each pipeline rank.

    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/_pipeline_memory.py \
        --data DIR --run-dir DIR --schedule 1f1b --microbatches 8

Builds meshrun's own Trainer (dp=1, pp=world size, fp32, no recompute) and runs a few
`train_step` calls with saved-tensor hooks on; writes one JSON file per rank with the peak
live saved bytes of every step (the first step also runs the stages' shape inference) to
RUN_DIR/memory-rank{R}.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from _saved_bytes import SavedBytes

from meshrun.config.schema import load_config
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.training.run import Run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    args = p.parse_args()
    pp = int(os.environ["WORLD_SIZE"])
    cfg = load_config(
        None,
        [
            f"model.num_layers={args.layers}",
            f"model.dim={args.dim}",
            f"model.num_heads={args.heads}",
            f"model.seq_len={args.seq_len}",
            "parallel.dp=1",
            f"parallel.pp={pp}",
            f"parallel.schedule={args.schedule}",
            f"train.micro_batch={args.micro_batch}",
            f"train.global_batch={args.micro_batch * args.microbatches}",
            f"train.steps={args.steps}",
            f"train.log_interval={args.steps + 1}",
            "train.eval_interval=0",
            "precision=fp32",
            "recompute=none",
            "tracker.mode=disabled",
            "checkpoint.at_end=false",
            f"data.dir={args.data}",
            f"run_dir={args.run_dir}",
        ],
    )
    mesh = init_mesh(Layout(pp=pp, per_rank=1))
    run = None
    try:
        run = Run(cfg, mesh, Path(args.data))
        trainer = run.trainer
        counter = SavedBytes(exclude=trainer.params)
        peaks = []
        for step in range(args.steps):
            counter.reset_peak()
            with counter.hooks():
                trainer.train_step(step)
            peaks.append(counter.peak)
        result = {
            "pp_rank": mesh.coordinates.pp,
            "pp": pp,
            "schedule": args.schedule,
            "microbatches": args.microbatches,
            "peaks": peaks,
            "live_after": counter.live,
        }
        (Path(args.run_dir) / f"memory-rank{mesh.rank}.json").write_text(json.dumps(result))
    finally:
        if run is not None:
            run.close()
        shutdown()


if __name__ == "__main__":
    main()
