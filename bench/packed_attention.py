"""Attention over packed documents on this CPU: what keeps each document to itself, at what cost.

    python bench/packed_attention.py [--quick] [--seq-lens 512 1024 2048] [--docs 8] [--rows 2]
        [--heads 4] [--head-dim 32] [--reps 5] [--rounds 2]

For rows of `--seq-lens` tokens holding about `--docs` documents each (lengths seeded, every row
different), forward + backward of causal attention (q, k, v of shape rows x heads x seq x
head_dim, fp32, one thread) done four ways:
- `nomask`: SDPA `is_causal=True` over the whole row: what pretraining does (documents see each other);
- `dense`: SDPA with a (seq x seq) boolean block-diagonal causal mask per row, built in the step;
- `loop`: SDPA `is_causal=True` on each document's slice, concatenated;
- `flex`: `flex_attention` with a document `create_block_mask`, eager and `torch.compile`d.
Each (way, seq_len) runs in a fresh process (peak memory is that process's high-water mark
over the step, reset before it: /proc/self/clear_refs), ways alternating order per round;
times are medians. `dense` and `loop` must agree with each other (outputs and gradients) before
anything is timed; a way that cannot run here prints why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from _process_memory import peak_mb_since, reset_peak
from _quick import exit_code, parse

WAYS = ("nomask", "dense", "loop", "flex", "flex-compiled")


def doc_lengths(seq_len: int, docs: int, rows: int, seed: int = 0) -> list[list[int]]:
    """Per row, `docs` document lengths summing to seq_len (a seeded random partition)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        cuts = torch.randperm(seq_len - 1, generator=gen)[: docs - 1].add(1).sort().values.tolist()
        out.append([b - a for a, b in zip([0, *cuts], [*cuts, seq_len])])
    return out


def attend(way: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[list[int]]) -> torch.Tensor:
    """Causal attention of each row's documents to themselves (`nomask`: to the whole row)."""
    if way == "nomask":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if way == "loop":
        rows = []
        for r, row in enumerate(lengths):
            parts = torch.split(torch.stack([q[r], k[r], v[r]]), row, dim=2)
            rows.append(torch.cat([F.scaled_dot_product_attention(*p, is_causal=True) for p in parts], dim=1))
        return torch.stack(rows)
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    if way == "dense":
        seq = q.shape[2]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        mask = (doc[:, :, None] == doc[:, None, :]) & causal  # (rows, seq, seq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def same_document(b, h, qi, ki):
        return (doc[b, qi] == doc[b, ki]) & (qi >= ki)

    block = create_block_mask(same_document, len(lengths), None, q.shape[2], q.shape[2], device="cpu")
    run = torch.compile(flex_attention) if way == "flex-compiled" else flex_attention
    return run(q, k, v, block_mask=block)


def inputs(args: argparse.Namespace, seq_len: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    torch.manual_seed(0)
    qkv = [torch.randn(args.rows, args.heads, seq_len, args.head_dim, requires_grad=True) for _ in range(3)]
    return qkv, doc_lengths(seq_len, args.docs, args.rows)


def child(args: argparse.Namespace) -> dict:
    """One way at one seq_len, in this fresh process: median ms of forward + backward, peak MB."""
    torch.set_num_threads(1)
    (q, k, v), lengths = inputs(args, args.seq)
    times = []
    try:
        attend(args.child, q, k, v, lengths).sum().backward()  # warm-up (and compile)
        before = reset_peak()
        for _ in range(args.reps):
            start = time.perf_counter()
            attend(args.child, q, k, v, lengths).sum().backward()
            times.append(1000 * (time.perf_counter() - start))
    except Exception as exc:  # noqa: BLE001 - a way this CPU build cannot run: say why
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return {"ms": statistics.median(times), "peak_mb": peak_mb_since(before)}


def check_agreement(args: argparse.Namespace) -> bool:
    """`dense` and `loop` give the same outputs and gradients; `nomask` does not (documents leak)."""
    (q, k, v), lengths = inputs(args, args.seq_lens[0])
    results = []
    for way in ("dense", "loop", "nomask"):
        out = attend(way, q, k, v, lengths)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, *grads))
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-4) for a, b in zip(results[0], results[1]))
    leaks = not torch.allclose(results[0][0], results[2][0], rtol=1e-5, atol=1e-4)
    print(f"dense == loop (outputs, gradients): {same}; nomask differs (documents see each other): {leaks}")
    return same and leaks


def run_child(args: argparse.Namespace, way: str, seq: int) -> dict:
    common = ["--rows", args.rows, "--docs", args.docs, "--heads", args.heads, "--head-dim", args.head_dim]
    cmd = [sys.executable, __file__, "--child", way, "--seq", seq, "--reps", args.reps, *common]
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, check=False)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if out.returncode == 0 and lines else {"error": out.stderr.strip()[-200:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--docs", type=int, default=8, help="documents per row")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--reps", type=int, default=5, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=2, help="rounds, way order alternating")
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parse(p, {"seq_lens": [64], "reps": 1, "rounds": 1, "ways": ["nomask", "dense", "loop", "flex"]}, argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    correct = check_agreement(args)
    print("| seq | way | fwd+bwd ms (median) | x nomask | peak MB over the step |")
    print("|---|---|---|---|---|")
    ratios = {}
    for seq in args.seq_lens:
        runs: dict[str, list[dict]] = {way: [] for way in args.ways}
        for r in range(args.rounds):
            for way in args.ways if r % 2 == 0 else args.ways[::-1]:
                runs[way].append(run_child(args, way, seq))
        base = statistics.median(x["ms"] for x in runs["nomask"] if "ms" in x) if "nomask" in runs else None
        for way, got in runs.items():
            ok = [x for x in got if "ms" in x]
            if not ok:
                print(f"| {seq} | {way} | cannot run: {got[0]['error']} | | |")
                continue
            ms, mb = statistics.median(x["ms"] for x in ok), statistics.median(x["peak_mb"] for x in ok)
            ratios[(seq, way)] = ms / base if base else float("nan")
            print(f"| {seq} | {way} | {ms:.1f} | {ratios[(seq, way)]:.2f}x | {mb:.1f} |")
    masked = [ratios[(s, w)] for s in args.seq_lens for w in ("dense", "loop") if (s, w) in ratios]
    print(f"best document-masked way / nomask at the longest seq: {min(masked[-2:], default=float('nan')):.2f}x")
    return exit_code(correct, quick=args.quick, correct=correct)


if __name__ == "__main__":
    raise SystemExit(main())
