"""LoRA vs full fine-tuning of the same Llama-shaped model on the same layout: trainable state per
rank, checkpoint size, step time and peak memory, side by side.

Each side is the real CLI (`python -m meshrun train`) on one job that differs only in `model.lora`
(r=16, alpha=32 on q_proj, k_proj, v_proj, o_proj: the issue's setting). The sides take turns
(A B, then B A, ...) for `--rounds` rounds; a run's step time is the median of its logged steps
after the first (warm-up) one, and the step-time figure is the median of the per-round ratios.
Trainable state per rank is measured by each run: `state_bytes` for full fine-tuning (parameters +
gradients + AdamW state on the largest rank, after the first step), `trainable_state_bytes` for LoRA
(the same of the adapters only: the frozen base is held, never given a gradient or optimizer state).
The checkpoint written at the end is measured on disk (LoRA's holds the adapters and their AdamW
state only). Target (issue 42): LoRA's trainable state <= 3% of full fine-tuning's. On a CPU the
frozen backward still computes input gradients: expect a step-time ratio of about 0.7-0.9.

    python bench/lora.py                          # ~1 minute on 2 busy cores: 3 rounds of 4 steps, one process
    python bench/lora.py --dp 2 --rounds 5        # ddp over 2 processes
    python bench/lora.py --quick                  # seconds: one round of 3 steps, a 2-layer d32 Llama
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
import torch

from meshrun.data.prepare import default_sources, prepare

TARGET = 0.03  # LoRA's trainable state / full fine-tuning's, per rank
LORA = [
    "--set=model.lora.r=16",
    "--set=model.lora.alpha=32",
    "--set=model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (the step-time figure is their median)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512, help="hidden size (heads of 64, half as many kv heads)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dp", type=int, default=1, help="ddp replicas (each rank holds the whole model)")
    p.add_argument("--precision", default="fp32")
    tiny = {"rounds": 1, "steps": 3, "layers": 2, "dim": 32, "seq_len": 16, "global_batch": 4, "micro_batch": 2}
    return _quick.parse(p, tiny)


def save_llama(args: argparse.Namespace, out: Path) -> Path:
    """A Llama-shaped model (GQA, SwiGLU MLP of 8/3 x dim rounded up to 8, untied head; byte vocabulary)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    heads = max(2, args.dim // 64)
    config = LlamaConfig(
        hidden_size=args.dim,
        intermediate_size=-(-8 * args.dim // 3 // 8) * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        vocab_size=256,
        max_position_embeddings=max(256, args.seq_len),
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def settings(args: argparse.Namespace, model: Path, data_dir: Path, run_dir: Path) -> list[str]:
    values = {
        "model.hf": model,
        "model.seq_len": args.seq_len,
        "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch,
        "train.steps": args.steps,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.warmup_steps": 1,
        "precision": args.precision,
        "recompute": "none",
        "parallel.dp": args.dp,
        "parallel.pp": 1,
        "tracker.mode": "disabled",
        "metrics.plots": "false",
        "checkpoint.interval": 0,
        "checkpoint.at_end": "true",
        "data.dir": data_dir,
        "run_dir": run_dir,
    }
    return [f"--set={k}={v}" for k, v in values.items()]


def run_side(
    args: argparse.Namespace, model: Path, data_dir: Path, run_dir: Path, extra: list[str]
) -> dict[str, float]:
    """One run: its median step time (after the first step), state and peak memory per rank, checkpoint bytes."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "meshrun", "train", *settings(args, model, data_dir, run_dir), *extra]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(extra) or 'full fine-tuning'} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    checkpoint = run_dir / "checkpoints" / f"step-{args.steps:08d}"
    return {
        "step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
        "state_bytes": rows[0]["state_bytes"],
        "trainable_bytes": rows[0].get("trainable_state_bytes", rows[0]["state_bytes"]),  # LoRA's, or all
        "peak_gb": max(r["memory_gb"] for r in rows),
        "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.glob("*.distcp")),
        "final_loss": rows[-1]["loss"],
    }


def main() -> None:
    args = parse_args()
    sides = {"A": ("full", []), "B": ("lora", LORA)}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, model = Path(tmp) / "data", save_llama(args, Path(tmp) / "llama")
        prepare(_quick.stdlib_text(quick=True) if args.quick else default_sources()[:60], data_dir, val_fraction=0.05)
        results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for round_ in range(args.rounds):
            for side in "AB" if round_ % 2 == 0 else "BA":
                run = Path(tmp) / f"{side}{round_}"
                results[side].append(run_side(args, model, data_dir, run, sides[side][1]))
                r = results[side][-1]
                print(
                    f"round {round_ + 1} {sides[side][0]:>4}: {r['step_s'] * 1e3:8.1f} ms/step, "
                    f"state {r['state_bytes'] / 2**20:.2f} MiB, peak {r['peak_gb']:.3f} GB, "
                    f"checkpoint {r['checkpoint_bytes'] / 2**20:.2f} MiB, loss {r['final_loss']:.4f}",
                    flush=True,
                )
    full, lora = results["A"][0], results["B"][0]
    trainable = lora["trainable_bytes"] / full["trainable_bytes"]
    ratios = [b["step_s"] / a["step_s"] for a, b in zip(results["A"], results["B"])]
    print(
        f"\nLlama-shaped {args.layers}L d{args.dim}, dp{args.dp} (ddp), r=16 on q/k/v/o:\n"
        f"step time lora / full: median {statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})\n"
        f"peak memory per rank: lora {lora['peak_gb']:.3f} GB, full {full['peak_gb']:.3f} GB\n"
        f"checkpoint: lora {lora['checkpoint_bytes'] / 2**20:.2f} MiB, full {full['checkpoint_bytes'] / 2**20:.2f} MiB "
        f"({lora['checkpoint_bytes'] / full['checkpoint_bytes']:.1%})"
    )
    finite = all(torch.isfinite(torch.tensor(r["final_loss"])) for side in results.values() for r in side)
    passed = trainable <= TARGET
    print(
        f"{'PASS' if passed else 'FAIL'}: trainable state per rank lora / full {trainable:.2%} "
        f"({lora['trainable_bytes'] / 2**20:.2f} of {full['trainable_bytes'] / 2**20:.2f} MiB; target <= {TARGET:.0%})"
    )
    sys.exit(_quick.exit_code(passed and finite, quick=args.quick, correct=finite))


if __name__ == "__main__":
    main()
