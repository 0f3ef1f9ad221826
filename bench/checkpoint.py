"""Training time blocked per checkpoint, asynchronous (`checkpoint.async`) vs synchronous.

One process (dp=1 x pp=1) builds meshrun's real `Trainer` on a GPT whose training state (weights
+ AdamW moments) is hundreds of MB, so that writing it dominates a save. Each round saves once
each way through `Trainer.save`, the order flipped every other round:

- blocked: the seconds `save` keeps training from going on (synchronous: the whole save, DCP
  write + fsync + checksums + publish; asynchronous: staging, i.e. the copy of the state);
- around the save: the next `--window` training steps, each followed by the poll that publishes a
  finished background write (what `Trainer.train` does); if the write is still going after them,
  the wait for it is counted too. steps/s around = window steps / (blocked + their time + that wait).

The verdict is the median of the per-round ratios async/sync blocked; target <= 0.2.

    python bench/checkpoint.py                     # ~300 MB of state, 5 rounds
    python bench/checkpoint.py --dim 768 --layers 6 --rounds 7
    python bench/checkpoint.py --quick             # seconds: a 1-layer d16 model, one round
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
import torch

from meshrun.config.schema import load_config
from meshrun.data.prepare import prepare
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.training.run import Run
from meshrun.training.trainer import Trainer

TARGET = 0.2  # async blocked / sync blocked


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds of one sync and one async save (median)")
    p.add_argument("--window", type=int, default=6, help="training steps timed after each save")
    p.add_argument("--baseline", type=int, default=6, help="steps per round timed with no save around")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--run-dir", type=Path, default=None, help="where checkpoints go (default: a temp folder)")
    tiny = {"rounds": 1, "window": 1, "baseline": 1, "threads": 1, "layers": 1, "dim": 16, "seq_len": 8}
    return _quick.parse(p, tiny)


def start_run(args: argparse.Namespace, run_dir: Path, data_dir: Path) -> Run:
    steps = 1_000_000  # never reached: the bench drives train_step and save itself
    cfg = load_config(
        None,
        [
            f"model.num_layers={args.layers}",
            f"model.dim={args.dim}",
            f"model.num_heads={max(1, args.dim // 64)}",
            f"model.seq_len={args.seq_len}",
            f"train.global_batch={args.global_batch}",
            f"train.micro_batch={args.global_batch}",
            f"train.steps={steps}",
            "train.eval_interval=0",
            f"train.log_interval={steps}",
            "precision=fp32",
            "parallel.dp=1",
            "parallel.pp=1",
            "tracker.mode=disabled",
            "checkpoint.async=true",  # the background saver exists; each save picks its way
            "checkpoint.keep=2",
            f"data.dir={data_dir}",
            f"run_dir={run_dir}",
        ],
    )
    return Run(cfg, init_mesh(Layout()), data_dir)


class Bench:
    def __init__(self, trainer: Trainer, window: int) -> None:
        self.trainer, self.window, self.step = trainer, window, 0

    def train(self, steps: int) -> float:
        """Seconds for `steps` training steps, each followed by the publishing poll."""
        start = time.perf_counter()
        for _ in range(steps):
            self.trainer.train_step(self.step)
            self.step += 1
            if self.trainer.background is not None:
                self.trainer.background.poll()
        return time.perf_counter() - start

    def save(self, background: bool) -> tuple[float, float]:
        """(blocked seconds, steps/s around the save)."""
        start = time.perf_counter()
        self.trainer.save(self.step, background=background)
        blocked = time.perf_counter() - start
        steps = self.train(self.window)
        waited_start = time.perf_counter()
        self.trainer.finish_background()  # a write outlasting the window: its wait counts
        waited = time.perf_counter() - waited_start
        return blocked, self.window / (blocked + steps + waited)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-", dir=args.run_dir) as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "data"
        prepare(_quick.stdlib_text(quick=args.quick), data_dir)
        training = start_run(args, tmp / "run", data_dir)
        try:
            return run(args, Bench(training.trainer, args.window))
        finally:
            training.close()
            shutdown()


def run(args: argparse.Namespace, bench: Bench) -> int:
    state = bench.trainer.state.state_dict(0)
    megabytes = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    del state
    print(
        f"meshrun checkpoint bench: {args.layers}L d{args.dim} T{args.seq_len} batch {args.global_batch}, "
        f"{megabytes:.0f} MB of state, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    bench.train(2)  # warm-up
    bench.save(background=False)
    bench.save(background=True)
    rows = []
    print(f"\n{'round':>5} {'sync blocked s':>14} {'async blocked s':>15} {'ratio':>6}   steps/s: none / sync / async")
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        measured = {background: bench.save(background) for background in order}
        baseline = args.baseline / bench.train(args.baseline)
        (sync_s, sync_rate), (async_s, async_rate) = measured[False], measured[True]
        rows.append((sync_s, async_s, async_s / sync_s, baseline, sync_rate, async_rate))
        print(
            f"{r + 1:>5} {sync_s:>14.3f} {async_s:>15.3f} {async_s / sync_s:>6.3f}"
            f"   {baseline:.2f} / {sync_rate:.2f} / {async_rate:.2f}"
        )
    med = [statistics.median(column) for column in zip(*rows)]
    print(f"{'median':>5} {med[0]:>14.3f} {med[1]:>15.3f} {med[2]:>6.3f}   {med[3]:.2f} / {med[4]:.2f} / {med[5]:.2f}")
    verdict = "PASS" if med[2] <= TARGET else "FAIL"
    print(f"\n{verdict}: async/sync blocked median {med[2]:.3f}x (target <= {TARGET}x)")
    return _quick.exit_code(verdict == "PASS", quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
