"""Each task's training step in meshrun vs a hand-written plain-torch loop, side by side in one process.

For classification (the built-in encoder on labelled texts of 1 to 40 words, padded), regression
(the time-series model on the generated seasonal series, horizon 7, mse), masked_lm (the encoder's
tokens head on the standard library's bytes, 15% masked) and causal_lm (GPT on the
standard library's bytes, the control: overhead.py's own comparison): side A is meshrun's real
`Trainer.train_step` on a one-process mesh; side B is overhead.py's nanoGPT-style loop around the
same model class with the same initial weights, the same batches (the task's dataset read by
global sample index), AdamW + clipping + warmup/cosine lr, and the task's loss written in plain
torch (cross-entropy over the labels; mse over the values after the window; cross-entropy over the
masked positions, summed and divided by the global batch's count of them). Turns alternate every
step, rounds of N steps, the verdict per task is the median of the per-round ratios (overhead.py's
`run`); the final losses must agree.

    python bench/tasks.py                              # CPU defaults, a few minutes on 2 cores
    python bench/tasks.py --tasks regression --rounds 9
    python bench/tasks.py --quick                      # seconds: 1-layer models, one round of 2 steps
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
import overhead
import torch
import torch.nn.functional as F

from meshrun.config.schema import Config
from meshrun.data.labelled import Example, prepare_classification
from meshrun.data.labelled_batches import LabelledDataset
from meshrun.data.masked_batches import MaskedWindows
from meshrun.data.prepare import prepare
from meshrun.data.series import EXAMPLE_COLUMNS, example_series, prepare_regression
from meshrun.data.series_batches import SeriesDataset
from meshrun.data.storage import IGNORE
from meshrun.models.families import build_model
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.training.run import Run

TASKS = ("classification", "regression", "masked_lm", "causal_lm")
HORIZON = 7
# The forecaster's loss after ~30 AdamW steps moves with last-bit differences between the two steps
# (equal to 0 after 5 steps, 2e-7 after 13, 5e-4 of 0.21 after 33 at the default size); the others hold 1e-4.
LOSS_TOLERANCE = {"regression": 1e-2}
WORDS = ["cat", "dog", "owl", "red", "blue", "teal", "one", "two", "six"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    overhead.step_arguments(p, steps=10, rounds=5)
    return _quick.parse(p, overhead.QUICK)


def labelled_texts(folder: Path) -> None:
    """600 texts of 1 to 40 words of three labels, prepared with bytes: most samples padded, some cut."""
    rng = random.Random(0)
    rows = []
    for n in range(600):
        label = rng.randrange(3)
        words = [rng.choice(WORDS[3 * label : 3 * label + 3]) for _ in range(rng.randint(1, 40))]
        rows.append(Example(" ".join(words), str(label), f"generated:{n}"))
    prepare_classification(rows, None, folder, val_fraction=0.1)


def task_job(task: str, args: argparse.Namespace, tmp: Path) -> tuple[Path, list[str]]:
    """The task's data folder (prepared here) and the `--set` overrides that make its job."""
    data_dir = tmp / task
    if task == "classification":
        labelled_texts(data_dir)
        return data_dir, ["task=classification", "model.name=encoder", "model.num_labels=3", "model.vocab_size=256"]
    if task == "regression":
        series = [example_series(3000)]
        prepare_regression(series, list(EXAMPLE_COLUMNS), data_dir, seq_len=args.seq_len, horizon=HORIZON)
        return data_dir, [
            "task=regression",
            "model.name=timeseries",
            f"model.features={len(EXAMPLE_COLUMNS)}",
            f"model.horizon={HORIZON}",
            f"task_options.horizon={HORIZON}",
        ]
    if task == "masked_lm":
        prepare(_quick.stdlib_text(quick=args.quick), data_dir, task="masked_lm")
        return data_dir, ["task=masked_lm", "model.name=encoder", "model.vocab_size=257"]  # bytes + the mask
    prepare(_quick.stdlib_text(quick=args.quick), data_dir)
    return data_dir, []


class MaskedMean:
    """masked_lm's batches for the hand loop and its loss: a microbatch's cross-entropy summed over
    its masked positions, divided by the GLOBAL batch's count of them (times the accumulation, which
    the hand loop divides by): the token mean over the global batch, as meshrun normalises."""

    def __init__(self, data: MaskedWindows, accumulation: int) -> None:
        self.data, self.accumulation, self.count = data, accumulation, 1

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(first, count)
        self.count = int((y != IGNORE).sum())
        return x, y

    def target_tokens(self, first: int, count: int) -> int:
        return self.data.target_tokens(first, count)

    def source_counts(self, first: int, count: int) -> dict[str, int]:
        return {}

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        summed = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE, reduction="sum")
        return summed * self.accumulation / self.count


def hand_loop(task: str, cfg: Config, device: torch.device, data_dir: Path) -> overhead.HandLoop:
    """overhead.py's loop around the task's model (meshrun's class, the trainer's init), its batches
    and its loss as a microbatch mean in plain torch."""
    model = build_model(cfg.model)  # on the meta device, as meshrun builds it
    model.to_empty(device=device)
    model.init_weights(cfg.train.seed)
    seq_len, seed = cfg.model.seq_len, cfg.train.seed
    if task == "classification":
        data = LabelledDataset(data_dir, "train", seq_len=seq_len, seed=seed)
        return overhead.HandLoop(cfg, device, data_dir, model, data=data, loss=F.cross_entropy)
    if task == "regression":
        data = SeriesDataset(data_dir, "train", seq_len=seq_len, horizon=HORIZON, seed=seed)
        return overhead.HandLoop(cfg, device, data_dir, model, data=data, loss=lambda out, y: F.mse_loss(out, y[:, 1:]))
    if task == "masked_lm":
        rate, accumulation = cfg.task_options.mask_rate, cfg.train.global_batch // cfg.train.micro_batch
        masked = MaskedMean(MaskedWindows(data_dir, "train", seq_len=seq_len, seed=seed, rate=rate), accumulation)
        return overhead.HandLoop(cfg, device, data_dir, model, data=masked, loss=masked.loss)
    return overhead.HandLoop(cfg, device, data_dir, model)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    medians: dict[str, float] = {}
    same = True
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-") as tmp_name:
        tmp = Path(tmp_name)
        mesh = init_mesh(Layout())  # a lone process: no torchrun, no ports
        try:
            for task in args.tasks:
                print(f"\n== task {task} ==")
                data_dir, extra = task_job(task, args, tmp)
                cfg = overhead.make_config(args, tmp / f"{task}-run", data_dir, extra)
                training = Run(cfg, mesh, data_dir)
                try:
                    hand = hand_loop(task, cfg, mesh.device, data_dir)
                    tolerance = LOSS_TOLERANCE.get(task) if cfg.precision == "fp32" else None
                    medians[task], agree = overhead.compare(
                        args, cfg, training.trainer, hand, mesh.device, tolerance=tolerance
                    )
                    same = same and agree
                finally:
                    training.close()
        finally:
            shutdown()
    passed = same and all(m <= overhead.TARGET for m in medians.values())
    shown = ", ".join(f"{task} {ratio:.3f}x" for task, ratio in medians.items())
    print(
        f"\n{'PASS' if passed else 'FAIL'}: every task's meshrun/hand median <= {overhead.TARGET:.2f}x ({shown})"
        + ("" if same else "; losses differ, so the two loops do not compute the same thing")
    )
    return _quick.exit_code(passed, quick=args.quick, correct=same)


if __name__ == "__main__":
    sys.exit(main())
