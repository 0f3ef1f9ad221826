"""Supervised fine-tuning on this CPU: packed documents vs one document a row, and what keeping
packed documents apart costs.

    python bench/sft.py [--quick] [--seq-len 1024] [--rows 4] [--steps 3] [--rounds 2]
        [--dim 128] [--layers 4] [--heads 4] [--kv-heads 2] [--vocab 512] [--docs 2000] [--sigma 0.8]

The bench writes a documents folder (as `prepare-data --chat` stores one: token shards, loss
masks, document starts, meta.json) whose lengths are log-normal with median seq_len / 5 and
shape `--sigma`, clipped to 2 .. seq_len (seeded); each document trains its last 70% of tokens
(the answer) and not its first 30% (the prompt). Each step is a real training step through
meshrun's own code: rows from `PackedDataset`, a Llama built by meshrun from an inline
`model.hf_config` (transformers' layers, GQA, rotary), the loss over trained targets
(`MicrobatchLoss`), backward, AdamW. Three sides, each in a fresh process (peak memory is that
process's high-water mark over the timed steps, reset before them: /proc/self/clear_refs),
their order alternating per round; numbers are medians over rounds, ratios the median of
each round's:
- `packed`: `data.packing: true`, each document attending only to itself;
- `padded`: `data.packing: false`, one document a row, padded to seq_len;
- `nomask`: the packed rows, ids alone: plain causal attention over the whole row, as pretraining
  does (documents see each other): what the attention path is compared against.
Trained tokens / s = the loss's targets / step time. Before timing, a packed row's summed loss is
checked equal to each of its documents run alone (and different from `nomask`'s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _process_memory import peak_mb_since, reset_peak
from _quick import exit_code, parse
from packing import lognormal_lengths

from meshrun.data.packed import PackedDataset
from meshrun.data.storage import DOCUMENTS_FORMAT, IGNORE, SplitWriter, smallest_dtype

SIDES = ("packed", "padded", "nomask")
PROMPT_SHARE = 0.3  # the untrained head of each document
TOLERANCE = 1e-6  # relative, fp32 logits summed in float64


def write_documents(folder: Path, args: argparse.Namespace) -> None:
    """A documents folder of `--docs` train documents (and one val document) with chat-like lengths."""
    rng = np.random.default_rng(0)
    meta_splits = {}
    for split, count in (("train", args.docs), ("val", 1)):
        lengths = np.maximum(lognormal_lengths(count, args.seq_len, args.sigma, seed=len(split)), 2)
        tokens = rng.integers(0, args.vocab, int(lengths.sum()))
        mask = np.concatenate([np.arange(n) >= round(PROMPT_SHARE * n) for n in lengths.tolist()])
        writer = SplitWriter(folder, split, smallest_dtype(args.vocab), 1 << 20, masks=True)
        writer.add(tokens, lengths, mask)
        meta_splits[split] = writer.close()
    meta = {
        "format": DOCUMENTS_FORMAT,
        "version": 1,
        "vocab_size": args.vocab,
        "dtype": smallest_dtype(args.vocab).name,
    }
    meta |= {"documents": sum(s["documents"] for s in meta_splits.values()), "splits": meta_splits}
    meta |= {f"{k}_tokens": meta_splits[k]["tokens"] for k in meta_splits}
    meta["trained_tokens"] = sum(s["trained_tokens"] for s in meta_splits.values())
    (folder / "meta.json").write_text(json.dumps(meta))


def build(args: argparse.Namespace, data_dir: Path) -> torch.nn.Module:
    """The Llama meshrun trains for `model.hf_config`, whole, on the CPU, fp32."""
    from meshrun.config.schema import Config
    from meshrun.parallel.materialise import materialise_part

    hf = {
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": 4 * args.dim,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq_len,
    }
    cfg = Config.model_validate(
        {
            "model": {"name": "hf", "hf_config": hf, "seq_len": args.seq_len, "vocab_size": args.vocab},
            "data": {"dir": str(data_dir)},
            "precision": "fp32",
        }
    )
    return materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)


def step_inputs(data: PackedDataset, side: str, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    x, y = data.batch(first, rows)
    return (x[:, 0] if side == "nomask" else x), y, data.target_tokens(first, rows)


def child(args: argparse.Namespace) -> dict:
    """`--steps` training steps of one side in this fresh process (after one warm-up step)."""
    from meshrun.training.loss import MicrobatchLoss

    torch.set_num_threads(1)
    data = PackedDataset(args.data, "train", seq_len=args.seq_len, seed=0, packing=args.child != "padded")
    model = build(args, args.data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(k: int) -> int:
        x, y, trained = step_inputs(data, args.child, k * args.rows, args.rows)
        MicrobatchLoss.for_batch(1, target_tokens=trained, dp=1)(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return trained

    step(0)
    before = reset_peak()
    start, trained = time.perf_counter(), sum(step(k) for k in range(1, args.steps + 1))
    seconds = time.perf_counter() - start
    padding = data.occupancy(args.rows, args.steps * args.rows).padding
    return {
        "trained_per_s": trained / seconds,
        "step_s": seconds / args.steps,
        "padding": padding / (args.steps * args.rows * args.seq_len),
        "peak_mb": peak_mb_since(before),
    }


def check_documents_apart(args: argparse.Namespace) -> bool:
    """A packed row of several documents: its summed loss equals its documents' run alone; ids
    alone (no separation) give another."""
    torch.manual_seed(0)
    data = PackedDataset(args.data, "train", seq_len=args.seq_len, seed=0, packing=True)
    model = build(args, args.data).eval()
    row = next(i for i in range(args.docs) if len(data.rows(i, 1)[0].docs) > 1)  # a row of several documents
    x, y = data.batch(row, 1)

    def summed(logits: torch.Tensor, targets: torch.Tensor) -> float:
        flat = logits.flatten(0, 1).double()
        return torch.nn.functional.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE, reduction="sum").item()

    with torch.no_grad():
        packed, leaky = summed(model(x), y), summed(model(x[:, 0]), y)
        alone, at = 0.0, 0
        for n in data.rows(row, 1)[0].lengths.tolist():
            alone += summed(model(x[:, 0, at : at + n]), y[:, at : at + n])
            at += n
    same = abs(packed - alone) <= TOLERANCE * abs(alone)
    leaks = abs(leaky - packed) > 10 * TOLERANCE * abs(packed)  # at init context moves the loss little
    print(f"packed row == its documents alone (summed loss): {same}; no separation differs: {leaks}")
    return same and leaks


def run_child(args: argparse.Namespace, side: str) -> dict:
    sizes = {"seq-len": args.seq_len, "rows": args.rows, "steps": args.steps, "dim": args.dim}
    sizes |= {"layers": args.layers, "heads": args.heads, "kv-heads": args.kv_heads, "vocab": args.vocab}
    cmd = [sys.executable, __file__, "--child", side, "--data", args.data]
    cmd += [str(c) for k, v in sizes.items() for c in (f"--{k}", v)]
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, check=False)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{side} failed: {out.stderr.strip()[-400:]}")
    return json.loads(lines[-1])


def measure(args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Every side `--rounds` times, order alternating: the median of each number, and the median
    over rounds of each round's ratios (sides of one round ran back to back: the load they shared
    cancels)."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            runs[side].append(run_child(args, side))
    medians = {side: {key: statistics.median(x[key] for x in got) for key in got[0]} for side, got in runs.items()}
    pairs = list(zip(runs["packed"], runs["padded"], runs["nomask"], strict=True))
    ratios = {
        "speedup": statistics.median(packed["trained_per_s"] / padded["trained_per_s"] for packed, padded, _ in pairs),
        "attention": statistics.median(packed["step_s"] / nomask["step_s"] for packed, _, nomask in pairs),
    }
    return medians, ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=4, help="rows per step (the global batch)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, side order alternating")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--docs", type=int, default=2000, help="train documents written")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal shape of the lengths")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    quick = {"seq_len": 128, "rows": 2, "steps": 1, "rounds": 1, "dim": 32, "layers": 2, "docs": 100, "vocab": 256}
    args = parse(p, quick, argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="meshrun-sft-bench-") as tmp:
        args.data = tmp
        write_documents(Path(tmp), args)
        correct = check_documents_apart(args)
        got, ratios = measure(args)
    print("| side | trained tokens/s | step s | padding | peak MB over the steps |")
    print("|---|---|---|---|---|")
    for side, m in got.items():
        print(f"| {side} | {m['trained_per_s']:.0f} | {m['step_s']:.3f} | {m['padding']:.1%} | {m['peak_mb']:.1f} |")
    speedup, attention = ratios["speedup"], ratios["attention"]
    memory_ok = got["packed"]["peak_mb"] <= got["padded"]["peak_mb"]
    goals = {
        f"packed / padded trained tokens/s {speedup:.2f}x (median of rounds; goal >= 2x)": speedup >= 2.0,
        f"packed padding {got['packed']['padding']:.1%} (goal <= 5%)": got["packed"]["padding"] <= 0.05,
        f"packed peak memory no higher than padded ({got['packed']['peak_mb']:.1f} vs {got['padded']['peak_mb']:.1f} MB)": memory_ok,
        f"packed step / no separation {attention:.2f}x (median of rounds; goal <= 1.15x)": attention <= 1.15,
    }
    for goal, met in goals.items():
        print(f"{'PASS' if met else 'FAIL'}: {goal}")
    return exit_code(all(goals.values()) and correct, quick=args.quick, correct=correct)


if __name__ == "__main__":
    raise SystemExit(main())
