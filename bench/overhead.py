"""meshrun's training step vs a minimal hand-written PyTorch loop, side by side in one process.

Both sides train the same GPT (meshrun.models.gpt, same initial weights) on the same batches
with the same precision, accumulation, AdamW + grad clipping and warmup/cosine lr. Side A is
meshrun's real `Trainer.train_step` on a one-process (dp=1, pp=1) mesh; side B is the loop
nanoGPT would write: autocast, loss / accum, backward, clip_grad_norm_, step, zero_grad.

Shared machines are noisy, so the sides take turns (A B, B A, ... every `--chunk` steps) through
several rounds of N timed steps per side; a round's step time per side is the median over its
turns, and the verdict uses the median of the per-round ratios. The losses after the last step
must agree (same computation), else the bench fails whatever the timing.

    python bench/overhead.py                       # CPU defaults, ~1-2 minutes on 2 cores
    python bench/overhead.py --precision bf16 --rounds 7 --steps 20
    python bench/overhead.py --quick               # seconds: a 1-layer model, one round of 2 steps
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
import torch
import torch.nn.functional as F

from meshrun.config.schema import Config, load_config
from meshrun.data.dataset import TokenDataset
from meshrun.data.prepare import prepare
from meshrun.models.gpt import GPT
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.tasks import Batches
from meshrun.training.run import Run
from meshrun.training.trainer import Trainer

TARGET = 1.03  # meshrun step time / hand-written step time
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    step_arguments(p, steps=20, rounds=7)
    p.add_argument(
        "--source",
        nargs="+",
        default=None,
        help="text files/globs to train on (default: the stdlib's top-level *.py files)",
    )
    return _quick.parse(p, {**QUICK, "source": _quick.stdlib_text(quick=True)})


QUICK = dict(
    steps=2, rounds=1, warmup=1, threads=1, layers=1, dim=16, heads=2, seq_len=8, global_batch=4, micro_batch=2
)
"""`--quick`'s values of step_arguments."""


def step_arguments(p: argparse.ArgumentParser, *, steps: int, rounds: int) -> None:
    """The flags of a meshrun-vs-hand step comparison (also bench/tasks.py's): precision, rounds, the model's shape."""
    p.add_argument("--precision", choices=list(DTYPES), default="fp32")
    p.add_argument("--steps", type=int, default=steps, help="timed optimizer steps per side per round")
    p.add_argument("--rounds", type=int, default=rounds, help="alternating rounds (the verdict is their median ratio)")
    p.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="steps per turn (default: 1 on CPU; 10 on CUDA, so syncs inside a step are not hidden by ours)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side before the first round")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads, the same for both sides")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)


def make_config(args: argparse.Namespace, tmp: Path, data_dir: Path, extra: list[str] | None = None) -> Config:
    """The one-process job both sides run; `extra`: more `--set` overrides (bench/tasks.py's task and model)."""
    total_steps = args.warmup + args.rounds * args.steps
    return load_config(
        None,
        [
            f"model.num_layers={args.layers}",
            f"model.dim={args.dim}",
            f"model.num_heads={args.heads}",
            f"model.seq_len={args.seq_len}",
            "model.dropout=0.0",
            f"train.global_batch={args.global_batch}",
            f"train.micro_batch={args.micro_batch}",
            f"train.steps={total_steps}",
            "train.eval_interval=0",
            f"train.log_interval={total_steps}",
            f"precision={args.precision}",
            "recompute=none",
            "parallel.dp=1",
            "parallel.pp=1",
            "tracker.mode=disabled",
            "checkpoint.at_end=false",
            "checkpoint.interval=0",
            f"data.dir={data_dir}",
            f"run_dir={tmp / 'run'}",
            *(extra or []),
        ],
    )


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of logits (..., V) against targets (...)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class HandLoop:
    """The minimal loop, written the way nanoGPT's train.py writes it."""

    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        data_dir: Path,
        model: torch.nn.Module | None = None,
        *,
        data: Batches | None = None,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss,
    ) -> None:
        """`model`: any module from the batches' x to what `loss` (a microbatch mean) reads (default:
        meshrun's GPT with the trainer's init, token windows, the token cross-entropy)."""
        t = cfg.train
        self.cfg, self.device = cfg, device
        if model is None:
            model = GPT(cfg.model)
            model.init_weights(t.seed)
        self.model = model.to(device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, fused=device.type == "cuda" or None)
        self.data = data or TokenDataset(data_dir, "train", seq_len=cfg.model.seq_len, seed=t.seed)
        self.loss = loss
        self.accum = t.global_batch // t.micro_batch
        dtype = DTYPES[cfg.precision]
        self.ctx = (
            (lambda: torch.autocast(device.type, dtype=dtype))
            if dtype
            else (lambda: torch.autocast(device.type, enabled=False))
        )

    def get_lr(self, step: int) -> float:
        t = self.cfg.train
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        ratio = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        min_lr = t.lr * t.min_lr_ratio
        return min_lr + coeff * (t.lr - min_lr)

    def train_step(self, step: int) -> torch.Tensor:
        t = self.cfg.train
        x, y = self.data.batch(step * t.global_batch, t.global_batch)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        lr = self.get_lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for xm, ym in zip(x.chunk(self.accum), y.chunk(self.accum)):
            with self.ctx():
                loss = self.loss(self.model(xm), ym) / self.accum
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def timed(
    step_fn: Callable[[int], torch.Tensor], first: int, count: int, *, device: torch.device
) -> tuple[float, torch.Tensor]:
    """Seconds per step over `count` steps from optimizer step `first`, and the last loss."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for step in range(first, first + count):
        loss = step_fn(step)
    sync()
    return (time.perf_counter() - start) / count, loss


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "data"
        prepare(args.source or [str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")], data_dir)
        cfg = make_config(args, tmp, data_dir)
        mesh = init_mesh(Layout())  # a lone process: no torchrun, no ports
        try:
            training = Run(cfg, mesh, data_dir)
            try:
                return run(args, cfg, training.trainer, HandLoop(cfg, mesh.device, data_dir), mesh.device)
            finally:
                training.close()
        finally:
            shutdown()


def run(args: argparse.Namespace, cfg: Config, trainer: Trainer, hand: HandLoop, device: torch.device) -> int:
    """The comparison and its verdict; the exit code."""
    median, same = compare(args, cfg, trainer, hand, device)
    verdict = same and median <= TARGET
    print(
        f"{'PASS' if verdict else 'FAIL'}: meshrun/hand median {median:.3f}x (target <= {TARGET:.2f}x)"
        + ("" if same else "; losses differ, so the two loops do not compute the same thing")
    )
    return _quick.exit_code(verdict, quick=args.quick, correct=same)


def compare(
    args: argparse.Namespace,
    cfg: Config,
    trainer: Trainer,
    hand: HandLoop,
    device: torch.device,
    *,
    tolerance: float | None = None,
) -> tuple[float, bool]:
    """Both sides' steps in alternating rounds, a table of them: (the median of the per-round
    meshrun/hand ratios, whether the final losses agree to `tolerance` x max(1, loss);
    default fp32 1e-4, bf16 2e-2)."""
    sides = {"meshrun": lambda step: trainer.train_step(step).loss, "hand": hand.train_step}  # its StepResult's loss
    chunk = args.chunk or (10 if device.type == "cuda" else 1)
    print(
        f"meshrun overhead bench: {cfg.model.num_layers}L d{cfg.model.dim} h{cfg.model.num_heads} "
        f"T{cfg.model.seq_len}, global batch {cfg.train.global_batch} = {cfg.accumulation_steps} x "
        f"micro {cfg.train.micro_batch}, {cfg.precision}, device {device}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print(
        f"warm-up {args.warmup} steps per side, then {args.rounds} rounds x {args.steps} timed steps per side, "
        f"taking turns every {chunk} step(s)\n"
    )
    losses = {}
    for name, fn in sides.items():
        _, losses[name] = timed(fn, 0, args.warmup, device=device)

    # Within a round the sides take turns every `chunk` steps (who goes first alternates), so a
    # burst of load from other processes lands on both; a round's ms/step is the median chunk.
    step, ratios = args.warmup, []
    header = f"{'round':>5}  {'meshrun ms/step':>15} {'hand ms/step':>13} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for r in range(args.rounds):
        times: dict[str, list[float]] = {name: [] for name in sides}
        for k, begin in enumerate(range(step, step + args.steps, chunk)):
            n = min(chunk, step + args.steps - begin)
            for name in list(sides) if k % 2 == 0 else list(reversed(sides)):
                seconds, losses[name] = timed(sides[name], begin, n, device=device)
                times[name].append(seconds)
        step += args.steps
        a, b = statistics.median(times["meshrun"]), statistics.median(times["hand"])
        ratios.append(a / b)
        print(f"{r + 1:>5}  {a * 1e3:>15.2f} {b * 1e3:>13.2f} {a / b:>7.3f}")

    median = statistics.median(ratios)
    print("-" * len(header))
    print(f"{'median':>5}  {'':>15} {'':>13} {median:>7.3f}   (min {min(ratios):.3f}, max {max(ratios):.3f})")

    a, b = float(losses["meshrun"]), float(losses["hand"])
    tolerance = tolerance or (1e-4 if cfg.precision == "fp32" else 2e-2)
    same = abs(a - b) <= tolerance * max(1.0, abs(b))
    print(
        f"\nloss after step {step}: meshrun {a:.6f}, hand {b:.6f}, |diff| {abs(a - b):.2e} "
        f"(tolerance {tolerance:g}): {'same' if same else 'DIFFERENT'}"
    )
    return median, same


if __name__ == "__main__":
    sys.exit(main())
