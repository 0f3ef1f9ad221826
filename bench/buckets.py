"""Length buckets for pairs data (issue 16): padding and step time with vs without `data.buckets`.

Data: the built-in seq2seq example (standard-library snake_case names -> CamelCase), prepared in
a temp dir. Padding: over `--batches` global batches, the share of input positions that hold a
real token, each way. Step time: the real CLI (`python -m meshrun train`, an encoder-decoder at
pp=2 with 1F1B, so every bucket shape builds its own pipeline schedule) run with and without
buckets, taking turns (A B, then B A, ...) for `--rounds` rounds; a run's step time is the
median of its logged steps (a bucket's first step, which infers its shapes, counts like any
other, but the median hides it); the verdict is the median of the per-round ratios.

    python bench/buckets.py                      # ~3-6 minutes on 2 busy cores
    python bench/buckets.py --rounds 3 --steps 30 --buckets 24,36
    python bench/buckets.py --quick              # seconds: one round of 2 steps, d16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path

from meshrun.config.schema import DataConfig
from meshrun.data.dataset import open_dataset
from meshrun.data.pairs import PAD, example_pairs, prepare_pairs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (the verdict is their median ratio)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--batches", type=int, default=200, help="global batches counted for the padding share")
    p.add_argument("--dim", type=int, default=64, help="model width (larger: compute, not overhead, dominates)")
    p.add_argument("--seq-len", type=int, default=48)
    p.add_argument("--source-len", type=int, default=24)
    p.add_argument("--buckets", default="20,28,36", help="data.buckets (model.seq_len is always one)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    return _quick.parse(p, {"rounds": 1, "steps": 2, "batches": 5, "dim": 16, "global_batch": 8, "micro_batch": 2})


def layout(args: argparse.Namespace) -> dict[str, object]:
    return {
        "model.name": "encdec",
        "model.num_layers": 4,
        "model.dim": args.dim,
        "model.num_heads": 4,
        "model.seq_len": args.seq_len,
        "model.source_len": args.source_len,
        "model.vocab_size": 259,
        "model.tie_embeddings": True,
        "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch,
    }


def positions(args: argparse.Namespace, data_dir: Path, buckets: list[int]) -> tuple[int, int]:
    """(real tokens, input positions) of the first `--batches` global batches."""
    data = open_dataset(
        DataConfig(dir=str(data_dir), buckets=buckets),
        data_dir,
        "train",
        seq_len=args.seq_len,
        seed=1337,
        source_len=args.source_len,
        global_batch=args.global_batch,
    )
    real = padded = 0
    for step in range(args.batches):
        x, _ = data.batch(step * args.global_batch, args.global_batch)
        real, padded = real + int((x != PAD).sum()), padded + x.numel()
    return real, padded


def step_time(args: argparse.Namespace, data_dir: Path, run_dir: Path, buckets: list[int]) -> float:
    values = {
        **layout(args),
        "data.dir": data_dir,
        "data.buckets": buckets,
        "parallel.pp": 2,
        "parallel.schedule": "1f1b",
        "train.steps": args.steps,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "precision": "fp32",
        "tracker.mode": "disabled",
        "run_dir": run_dir,
        "checkpoint.at_end": False,
    }
    command = [sys.executable, "-m", "meshrun", "train", *(f"--set={k}={v}" for k, v in values.items())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"meshrun train (buckets {buckets}) failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if "step_time_s" in r)


def main() -> None:
    args = parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "pairs"
        prepare_pairs(example_pairs(), data_dir, val_fraction=0.1)
        for name, b in (("padded to seq_len", []), (f"buckets {buckets}", buckets)):
            real, padded = positions(args, data_dir, b)
            print(
                f"{name}: {padded / args.batches:.0f} input positions per step, {1 - real / padded:.1%} of them padding"
            )
        ratios = []
        for round_ in range(args.rounds):
            order = [("padded", []), ("buckets", buckets)][:: 1 if round_ % 2 == 0 else -1]
            times = {name: step_time(args, data_dir, Path(tmp) / f"{name}{round_}", b) for name, b in order}
            ratios.append(times["buckets"] / times["padded"])
            print(
                f"round {round_ + 1}: padded {times['padded'] * 1e3:.0f} ms/step, bucketed {times['buckets'] * 1e3:.0f} ms/step"
            )
        print(f"bucketed / padded step time: median {statistics.median(ratios):.2f}x over {args.rounds} rounds")
    sys.exit(_quick.exit_code(True, quick=args.quick))


if __name__ == "__main__":
    main()
