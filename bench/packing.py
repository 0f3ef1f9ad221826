"""How full the packer's rows are: best-fit decreasing (meshrun.data.packing) vs first-fit, best-fit
and greedy next-fit in the data order, on chat-like document lengths.

    python bench/packing.py [--quick] [--seq-lens 2048 4096] [--docs 1000 10000] [--sigma 0.8]

Lengths are log-normal with median seq_len / 5 and shape `--sigma`, rounded and clipped to
1 .. seq_len (a long tail that reaches seq_len), seeded. Fill = document tokens / row positions
(1 - the padding share). Deterministic: no timings, the same numbers on every machine.
"""

from __future__ import annotations

import argparse

import numpy as np
from _quick import exit_code, parse

from meshrun.data.packing import fill, pack


def lognormal_lengths(count: int, seq_len: int, sigma: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(seq_len / 5), sigma, count)), 1, seq_len).astype(np.int64)


def in_order(lengths: np.ndarray, seq_len: int, rule: str) -> float:
    """Fill of packing in the data order: `next` (greedy: a new row when the document does not
    fit the current one), `first` (the first open row with room), `best` (the tightest one)."""
    rooms = np.zeros(0, dtype=np.int64)
    for need in lengths.tolist():
        fits = np.flatnonzero(rooms >= need)
        if rule == "next":
            fits = fits[-1:] if len(rooms) and rooms[-1] >= need else fits[:0]
        if not len(fits):
            rooms = np.append(rooms, seq_len - need)
            continue
        row = fits[0] if rule != "best" else fits[np.argmin(rooms[fits])]
        rooms[row] -= need
    return 1.0 - rooms.sum() / (len(rooms) * seq_len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--docs", type=int, nargs="+", default=[1000, 10_000], help="documents per packed block")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal shape")
    args = parse(p, {"seq_lens": [256], "docs": [500]}, argv)
    print("| seq_len | documents | mean length | best-fit decreasing (meshrun) | best-fit | first-fit | next-fit |")
    print("|---|---|---|---|---|---|---|")
    worst_gain = np.inf
    for seq_len, docs in ((s, d) for s in args.seq_lens for d in args.docs):
        lengths = lognormal_lengths(docs, seq_len, args.sigma)
        ours = fill(pack(lengths, seq_len))
        others = [in_order(lengths, seq_len, rule) for rule in ("best", "first", "next")]
        worst_gain = min(worst_gain, ours - max(others))
        cells = " | ".join(f"{100 * f:.1f}%" for f in [ours, *others])
        print(f"| {seq_len} | {docs} | {lengths.mean():.0f} | {cells} |")
    passed = worst_gain >= 0
    print(f"{'PASS' if passed else 'FAIL'}: best-fit decreasing fills at least as well as the best in-order packer")
    return exit_code(passed, quick=args.quick)


if __name__ == "__main__":
    raise SystemExit(main())
