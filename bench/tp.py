"""Tensor parallelism on CPU: per-rank training state at tp2 vs tp1, step time, the share of a step
spent in collectives, and the planner's prediction of the shard bytes.

Each side is the real CLI (`python -m meshrun train`, torchrun, gloo on CPU / nccl on CUDA) on one
job that differs only in `parallel.tp` (1: one process; 2: two). The sides take turns (A B, then
B A, ...) for `--rounds` rounds; a run's step time is the median of its logged steps after the
first; the verdict is the median of the per-round ratios.

- state: `state_bytes` from metrics.jsonl (params + grads + AdamW state, measured on the largest
  rank after the first step) against `rank_state_bytes`, the planner's and --dry-run's count;
- collectives: the profiler traces the last step on rank 0 (`profile.steps`); the share is the
  summed time of its communication ops (all-reduce, reduce-scatter, all-gather, broadcast)
  over the step's wall time. On gloo these are CPU copies through loopback, not NVLink: the
  figure is printed so a GPU run can compare, and carries no target.

    python bench/tp.py                      # ~3-5 minutes on 2 busy cores
    python bench/tp.py --rounds 5 --dim 512
    python bench/tp.py --quick              # seconds: one round of 3 steps, a 1-layer d16 model
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

from meshrun.config.schema import load_config
from meshrun.data.prepare import default_sources, prepare
from meshrun.models.families import build_model
from meshrun.models.protocol import tp_plan
from meshrun.planner.layout_memory import rank_state_bytes

TARGET = 0.55  # tp2 / tp1 per-rank state, for a model whose blocks dominate
COLLECTIVES = ("allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather", "broadcast")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (the verdict is their median ratio)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=384, help="blocks dominate: 12 x dim^2 per block vs 2 x vocab x dim")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    tiny = {"rounds": 1, "steps": 3, "layers": 1, "dim": 16, "heads": 2, "seq_len": 8, "global_batch": 4}
    return _quick.parse(p, {**tiny, "micro_batch": 2})


def settings(args: argparse.Namespace, data_dir: Path, run_dir: Path, tp: int) -> list[str]:
    values = {
        "model.num_layers": args.layers,
        "model.dim": args.dim,
        "model.num_heads": args.heads,
        "model.vocab_size": args.vocab,
        "model.seq_len": args.seq_len,
        "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch,
        "train.steps": args.steps,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.warmup_steps": 1,
        "precision": "fp32",
        "recompute": "none",
        "parallel.dp": 1,
        "parallel.pp": 1,
        "parallel.tp": tp,
        "profile.steps": f"[{args.steps}]",
        "profile.ranks": "[0]",
        "tracker.mode": "disabled",
        "checkpoint.at_end": "false",
        "data.dir": data_dir,
        "run_dir": run_dir,
    }
    return [f"--set={k}={v}" for k, v in values.items()]


def collective_share(trace: Path) -> float:
    """Time in communication ops over the traced step's span (top-level CPU events only: an op's
    children are inside its own duration)."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    comm = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if any(c in e["name"].lower() for c in COLLECTIVES))
    busy, end = 0.0, float("-inf")
    for start, stop in comm:  # union of intervals: nested op names count once
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / span


def run_side(args: argparse.Namespace, data_dir: Path, run_dir: Path, tp: int) -> dict[str, float]:
    """One run: its median step time (after the first step), measured and planned state, comm share."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sets = settings(args, data_dir, run_dir, tp)
    done = subprocess.run(
        [sys.executable, "-m", "meshrun", "train", *sets], check=False, env=env, capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"tp {tp} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    planned = rank_state_bytes(load_config(None, [s.removeprefix("--set=") for s in sets]))
    assert planned is not None
    return {
        "step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
        "state": rows[0]["state_bytes"],
        "planned": max(m.params + m.grads + m.optimizer for m in planned),
        "comm": collective_share(run_dir / "profile" / f"step{args.steps}-rank0.json"),
        "final_loss": rows[-1]["loss"],
    }


def embedding_share(args: argparse.Namespace) -> float:
    """The vocabulary-split modules' share of the parameters (the embedding and the head, which tp
    splits as it does the blocks; position embeddings and norms stay whole), counted on the model
    itself, built on the meta device."""
    cfg = load_config(None, [s.removeprefix("--set=") for s in settings(args, Path("data"), Path("run"), tp=1)])
    with torch.device("meta"):
        model = build_model(cfg.model)
    plan = tp_plan(model) or {}
    vocab = {
        name for name, style in plan.items() if style in ("vocab_embedding", "vocab_embedding_scatter", "vocab_head")
    }
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for name, p in model.named_parameters() if name.rsplit(".", 1)[0] in vocab) / total


def main() -> None:
    args = parse_args()
    results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(_quick.stdlib_text(quick=True) if args.quick else default_sources()[:60], data_dir, val_fraction=0.05)
        for round_ in range(args.rounds):
            for tp in (1, 2) if round_ % 2 == 0 else (2, 1):
                results[tp].append(run_side(args, data_dir, Path(tmp) / f"tp{tp}-{round_}", tp))
                r = results[tp][-1]
                print(
                    f"round {round_ + 1} tp{tp}: {r['step_s'] * 1e3:8.1f} ms/step, state {r['state'] / 2**20:.2f} MiB "
                    f"(planned {r['planned'] / 2**20:.2f}), collectives {r['comm']:.0%} of the step, "
                    f"loss {r['final_loss']:.5f}",
                    flush=True,
                )
    one, two = results[1][0], results[2][0]
    ratios = [b["step_s"] / a["step_s"] for a, b in zip(results[1], results[2])]
    state = two["state"] / one["state"]
    print(f"\nembedding + head share of the parameters: {embedding_share(args):.1%}")
    print(f"per-rank state tp2 / tp1: {state:.3f} (target <= {TARGET})")
    print(f"planner / measured shard bytes at tp2: {two['planned'] / two['state']:.3f}")
    print(
        f"step time tp2 / tp1: median {statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(f"collectives' share of a tp2 step: median {statistics.median(r['comm'] for r in results[2]):.0%}")
    same = all(abs(a["final_loss"] - b["final_loss"]) < 1e-4 for a, b in zip(results[1], results[2]))
    print("final losses agree" if same else "FINAL LOSSES DIFFER")
    sys.exit(_quick.exit_code(same and state <= TARGET, quick=args.quick, correct=same))


if __name__ == "__main__":
    main()
