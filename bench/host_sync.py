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
checks the same step on the CPU by counting value reads instead). `--quick` runs the same loop at a
tiny size, on the CPU when there is no GPU, where the sync check itself (CUDA-only) is left out and
the output says so.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
import torch

from meshrun.config.schema import load_config
from meshrun.data.prepare import prepare
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.training.run import Run

SIZE = ("model.num_layers=4", "model.dim=256", "model.num_heads=4", "model.seq_len=256")
SIZE += ("train.global_batch=16", "train.micro_batch=4")
TINY = ("model.num_layers=1", "model.dim=16", "model.num_heads=2", "model.seq_len=8")
TINY += ("train.global_batch=2", "train.micro_batch=1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=["fp32", "bf16"], action="append", help="default: both")
    p.add_argument("--steps", type=int, default=20, help="checked steps after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="unchecked steps first (lazy allocation, cuBLAS handles)")
    return _quick.parse(p, {"steps": 2, "warmup": 1})


@contextmanager
def sync_errors(device: torch.device) -> Iterator[None]:
    """Make any device->host sync raise inside the block (CUDA only: elsewhere there is none to catch)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check(precision: str, args: argparse.Namespace, tmp: Path, data_dir: Path) -> bool:
    """True when `args.steps` steps ran with no device->host sync."""
    cfg = load_config(
        None,
        [
            *(TINY if args.quick else SIZE),
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
    run = None
    try:
        run = Run(cfg, mesh, data_dir)
        trainer = run.trainer
        window = torch.zeros((), device=mesh.device)
        for step in range(args.warmup):
            window = window + trainer.train_step(step).loss
        step = args.warmup
        try:
            with sync_errors(mesh.device):
                for step in range(args.warmup, args.warmup + args.steps):
                    window = window + trainer.train_step(step).loss
                    trainer.requests.poll()
        except RuntimeError:
            print(f"{precision}: FAIL, the step synchronised with the device (step {step + 1}):")
            traceback.print_exc(limit=-8, file=sys.stdout)
            return False
        mean = f"mean loss {float(window) / (args.warmup + args.steps):.4f}"
        if mesh.device.type != "cuda":
            print(f"{precision}: NOT CHECKED, {args.steps} steps ran on the CPU; the sync check needs CUDA ({mean})")
            return True
        print(
            f"{precision}: PASS, {args.steps} steps on {torch.cuda.get_device_name()} without a device->host sync ({mean})"
        )
        return True
    finally:
        if run is not None:
            run.close()
        shutdown()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() and not args.quick:
        print("host_sync.py needs CUDA (torch.cuda.set_sync_debug_mode); no GPU here, nothing measured.")
        return 0
    with tempfile.TemporaryDirectory(prefix="meshrun-sync-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "data"
        prepare(_quick.stdlib_text(quick=args.quick), data_dir)
        results = [check(precision, args, tmp, data_dir) for precision in args.precision or ["fp32", "bf16"]]
    return _quick.exit_code(all(results), quick=args.quick, correct=all(results))


if __name__ == "__main__":
    sys.exit(main())
