"""FSDP2 vs DDP at dp=2 on the same job: step time ratio and per-rank memory, side by side.

Each side is the real CLI (`python -m meshrun train`, torchrun, gloo on CPU / nccl on CUDA) on
one job that differs only in `parallel.dp_mode`. Shared machines are noisy, so the sides take
turns (A B, then B A, ...) for `--rounds` rounds; a run's step time is the median of its logged
steps after the first (warm-up) one, and the verdict is the median of the per-round ratios.
Memory per rank, from each run's metrics: `state_bytes` (params + grads + AdamW state, measured
on the largest rank after the first step) and `memory_gb` (CUDA: peak allocated; CPU: peak RSS,
which includes the ~0.4 GB every torch process has). A third side, `--reshard-check`, runs fsdp
at pp=2 with `fsdp_reshard_after_forward` on, against the default (off) under pipelining.

    python bench/fsdp.py                          # CPU defaults, ~5-8 minutes on 2 busy cores
    python bench/fsdp.py --rounds 5 --steps 8 --dim 256
    python bench/fsdp.py --reshard-check          # pp=2: reshard after forward on vs off
    python bench/fsdp.py --quick                  # seconds: one round of 3 steps, a 1-layer d16 model
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

from meshrun.data.prepare import default_sources, prepare


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (the verdict is their median ratio)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512, help="large enough that training state shows in peak memory")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument(
        "--reshard-check",
        action="store_true",
        help="compare fsdp pp=2 with reshard_after_forward on (B) and off (A) instead of fsdp vs ddp",
    )
    tiny = {"rounds": 1, "steps": 3, "layers": 1, "dim": 16, "heads": 2, "seq_len": 8, "global_batch": 4}
    return _quick.parse(p, tiny)


def settings(args: argparse.Namespace, data_dir: Path, run_dir: Path) -> list[str]:
    pp = 2 if args.reshard_check else 1
    values = {
        "model.num_layers": args.layers,
        "model.dim": args.dim,
        "model.num_heads": args.heads,
        "model.seq_len": args.seq_len,
        "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch,
        "train.steps": args.steps,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.warmup_steps": 1,
        "precision": args.precision,
        "recompute": "none",
        "parallel.dp": 2,
        "parallel.pp": pp,
        "tracker.mode": "disabled",
        "checkpoint.at_end": "false",
        "data.dir": data_dir,
        "run_dir": run_dir,
    }
    return [f"--set={k}={v}" for k, v in values.items()]


def run_side(args: argparse.Namespace, data_dir: Path, run_dir: Path, extra: list[str]) -> dict[str, float]:
    """One run; its median step time (after the first step) and per-rank memory."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "meshrun", "train", *settings(args, data_dir, run_dir), *extra]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(extra)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
        "state_mb": rows[0]["state_bytes"] / 2**20,
        "peak_gb": max(r["memory_gb"] for r in rows),
        "final_loss": rows[-1]["loss"],
    }


def main() -> None:
    args = parse_args()
    if args.reshard_check:
        sides = {
            "A": ("fsdp, reshard after forward off (default under pp)", ["--set=parallel.dp_mode=fsdp"]),
            "B": (
                "fsdp, reshard after forward on",
                ["--set=parallel.dp_mode=fsdp", "--set=parallel.fsdp_reshard_after_forward=true"],
            ),
        }
    else:
        sides = {"A": ("ddp", ["--set=parallel.dp_mode=ddp"]), "B": ("fsdp", ["--set=parallel.dp_mode=fsdp"])}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(_quick.stdlib_text(quick=True) if args.quick else default_sources()[:60], data_dir, val_fraction=0.05)
        results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for round_ in range(args.rounds):
            for side in "AB" if round_ % 2 == 0 else "BA":
                results[side].append(run_side(args, data_dir, Path(tmp) / f"{side}{round_}", sides[side][1]))
                r = results[side][-1]
                print(
                    f"round {round_ + 1} {sides[side][0]:>8}: {r['step_s'] * 1e3:8.1f} ms/step, "
                    f"state {r['state_mb']:.1f} MiB, peak {r['peak_gb']:.3f} GB, loss {r['final_loss']:.5f}",
                    flush=True,
                )
    ratios = [b["step_s"] / a["step_s"] for a, b in zip(results["A"], results["B"])]
    a0, b0 = results["A"][0], results["B"][0]
    print(
        f"\n{sides['B'][0]} / {sides['A'][0]} step time: median ratio {statistics.median(ratios):.3f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(
        f"per-rank training state: {b0['state_mb']:.1f} vs {a0['state_mb']:.1f} MiB "
        f"({b0['state_mb'] / a0['state_mb']:.3f}x); peak memory per rank: {b0['peak_gb']:.3f} vs {a0['peak_gb']:.3f} GB"
    )
    same = all(abs(a["final_loss"] - b["final_loss"]) < 1e-4 for a, b in zip(results["A"], results["B"]))
    print("final losses agree" if same else "FINAL LOSSES DIFFER")
    sys.exit(_quick.exit_code(same, quick=args.quick, correct=same))


if __name__ == "__main__":
    main()
