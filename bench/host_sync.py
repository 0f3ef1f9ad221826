"""Does meshrun's training step make the host wait for the GPU? (It should not.)

Builds meshrun's real `Trainer` on a one-process CUDA mesh (dp=1, pp=1), runs warm-up steps,
then runs `--steps` more steps of what the training loop does between two log lines
(`train_step`, accumulating the loss on the device, the stop/save-request poll) with
`torch.cuda.set_sync_debug_mode("error")`: any device->host synchronisation inside (`.item()`,
`bool(tensor)`, a blocking copy to the CPU, `torch.cuda.synchronize`) raises, and the bench
prints where it happened and exits 1. fp16 is left out: its GradScaler reads the loss scale on
the host every step by design.

    python bench/host_sync.py                 # fp32 and bf16
    python bench/host_sync.py --precision bf16 --steps 50

Without CUDA it says so and exits 0: there is nothing to measure (tests/training/test_host_sync.py
checks the same step on the CPU by counting value reads instead).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
import traceback
from pathlib import Path

import torch

from meshrun.config.schema import load_config
from meshrun.data.prepare import prepare
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.training.trainer import Trainer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=["fp32", "bf16"], action="append", help="default: both")
    p.add_argument("--steps", type=int, default=20, help="checked steps after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="unchecked steps first (lazy allocation, cuBLAS handles)")
    return p.parse_args()


def check(precision: str, args: argparse.Namespace, tmp: Path, data_dir: Path) -> bool:
    """True when `args.steps` steps ran with no device->host sync."""
    cfg = load_config(
        None,
        [
            "model.num_layers=4",
            "model.dim=256",
            "model.num_heads=4",
            "model.seq_len=256",
            "train.global_batch=16",
            "train.micro_batch=4",
            f"train.steps={args.warmup + args.steps}",
            "train.eval_interval=0",
            f"train.log_interval={args.warmup + args.steps}",
            f"precision={precision}",
            "tracker.mode=disabled",
            "checkpoint.at_end=false",
            f"data.dir={data_dir}",
            f"run_dir={tmp / precision}",
        ],
    )
    mesh = init_mesh(Layout())
    trainer = None
    try:
        trainer = Trainer(cfg, mesh, data_dir)
        window = torch.zeros((), device=mesh.device)
        for step in range(args.warmup):
            window = window + trainer.train_step(step).loss
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(args.warmup, args.warmup + args.steps):
                window = window + trainer.train_step(step).loss
                trainer.requests.poll()
        except RuntimeError:
            print(f"{precision}: FAIL, the step synchronised with the device (step {step + 1}):")
            traceback.print_exc(limit=-8, file=sys.stdout)
            return False
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(
            f"{precision}: PASS, {args.steps} steps on {torch.cuda.get_device_name()} without a device->host sync "
            f"(mean loss {float(window) / (args.warmup + args.steps):.4f})"
        )
        return True
    finally:
        if trainer is not None:
            trainer.close()
        shutdown()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("host_sync.py needs CUDA (torch.cuda.set_sync_debug_mode); no GPU here, nothing measured.")
        return 0
    with tempfile.TemporaryDirectory(prefix="meshrun-sync-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "data"
        prepare([str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")], data_dir)
        results = [check(precision, args, tmp, data_dir) for precision in args.precision or ["fp32", "bf16"]]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
