"""How close does meshrun get to this machine's matmul peak, next to a hand-written loop, eager and compiled?

1. The peak: best-of-5 TFLOP/s of torch.mm on large squares (fp32 and bf16) and on the model's own
   matmul shapes (tokens x dim @ dim x dim, dim x 4dim, 4dim x dim, dim x vocab).
2. The model FLOP/s (the model's own flops_per_token x tokens / step time) of meshrun's real
   `Trainer.train_step` and of the hand loop of bench/overhead.py on the same model, weights and
   batches, for the default job's model and a larger one (8 layers, dim 512, seq 512), eager and
   with train.compile (the hand loop's blocks compiled the same way). The four sides of a model take
   turns step by step, the order rotating; medians of the rounds.

    python bench/roofline.py                # 10-17 minutes on 2 shared cores
    python bench/roofline.py --rounds 5 --steps 3
    python bench/roofline.py --quick        # a 1-layer model, eager only, small squares

Targets: meshrun's fraction of the peak >= 0.97x the hand loop's in both modes; compiled >= 1.10x
eager (model FLOP/s) on the larger model. Reported, with the verdict; exit status 1 when missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
import torch
from overhead import HandLoop

from meshrun.config.schema import Config, load_config
from meshrun.data.prepare import prepare
from meshrun.models.families import build_model, flops_at
from meshrun.parallel.compile import apply_compile
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.training.run import Run

MODELS = {  # name -> (layers, dim, heads, seq, micro batch)
    "default": (4, 128, 4, 128, 4),
    "larger": (8, 512, 8, 512, 4),
    "tiny": (1, 16, 2, 8, 2),  # --quick's
}
MODES = {"eager": False, "compiled": True}  # --quick: eager only (inductor takes ~40 s for a tiny model on a CPU)
HAND_TARGET, COMPILE_TARGET = 0.97, 1.10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per model and mode")
    p.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["default", "larger"])
    p.add_argument("--squares", type=int, nargs="+", default=[1024, 2048], help="square matmul sizes for the peak")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    tiny = {"rounds": 1, "steps": 1, "threads": 1, "models": ["tiny"], "squares": [64], "modes": ["eager"]}
    return _quick.parse(p, tiny)


def tflops_of_mm(m: int, k: int, n: int, dtype: torch.dtype, *, reps: int = 5) -> float:
    """Best TFLOP/s of (m x k) @ (k x n) over `reps` timed calls (after one untimed): a peak is what
    the machine can do, and on a shared machine only the fastest call approaches it."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / min(times) / 1e12


def matmul_peaks(cfg_of: dict[str, Config], squares: list[int]) -> dict[str, float]:
    """Peak TFLOP/s by dtype: the best of every shape measured (printed). On a shared machine the
    large squares run slower than the model's small shapes (a long call loses its core to other
    processes mid-way), so the peak is the best anything reached, not the squares alone."""
    peaks = {}
    print("matmul TFLOP/s (best of 5)")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        square = {size: tflops_of_mm(size, size, size, dtype) for size in squares}
        print(f"  {name} squares: " + ", ".join(f"{s}^3 {t:.3f}" for s, t in square.items()))
        best = max(square.values())
        for model, cfg in cfg_of.items():
            tokens, dim, vocab = cfg.train.micro_batch * cfg.model.seq_len, cfg.model.dim, cfg.model.vocab_size
            shapes = {"qkvo": (tokens, dim, dim), "fc": (tokens, dim, 4 * dim), "proj": (tokens, 4 * dim, dim)}
            shapes["head"] = (tokens, dim, vocab)
            measured = {s: tflops_of_mm(*mkn, dtype) for s, mkn in shapes.items()}
            best = max(best, *measured.values())
            print(f"  {name} {model} model shapes: " + ", ".join(f"{s} {t:.3f}" for s, t in measured.items()))
        peaks[name] = best
    return peaks


def make_config(model: str, tmp: Path, data_dir: Path, *, compiled: bool, steps: int) -> Config:
    layers, dim, heads, seq, micro = MODELS[model]
    settings = {
        "model.num_layers": layers,
        "model.dim": dim,
        "model.num_heads": heads,
        "model.seq_len": seq,
        "model.vocab_size": 2048,
        "model.dropout": 0.0,
        "train.global_batch": micro,
        "train.micro_batch": micro,
        "train.steps": steps,
        "train.eval_interval": 0,
        "train.log_interval": steps,
        "train.compile": compiled,
        "precision": "fp32",
        "parallel.dp": 1,
        "parallel.pp": 1,
        "tracker.mode": "disabled",
        "checkpoint.at_end": False,
        "data.dir": data_dir,
        "run_dir": tmp / f"{model}-{compiled}",
    }
    return load_config(None, [f"{k}={v}" for k, v in settings.items()])


def step_seconds(fn: Callable[[int], object], step: int) -> float:
    start = time.perf_counter()
    fn(step)
    return time.perf_counter() - start


def measure(cfgs: dict[bool, Config], data_dir: Path, args: argparse.Namespace) -> dict[tuple[str, bool], float]:
    """Model TFLOP/s of meshrun and the hand loop, eager and compiled (`cfgs` by compiled), on one
    model: the four sides take turns step by step (the order rotating), medians over rounds."""
    cfg = next(iter(cfgs.values()))  # the same model in every mode
    flops_per_step = flops_at(build_model(cfg.model), cfg.model.seq_len) * cfg.tokens_per_step
    mesh = init_mesh(Layout())
    runs = []
    try:
        sides: dict[tuple[str, bool], Callable[[int], object]] = {}
        for compiled, cfg in cfgs.items():
            runs.append(Run(cfg, mesh, data_dir))
            hand = HandLoop(cfg, mesh.device, data_dir)
            if compiled:
                apply_compile(hand.model.blocks, strict=True, warn=print)
            sides[("meshrun", compiled)], sides[("hand", compiled)] = runs[-1].trainer.train_step, hand.train_step
        for fn in sides.values():
            fn(0)  # warm-up (and compilation)
            fn(1)
        order, rounds = list(sides), {key: [] for key in sides}
        step = 2
        for r in range(args.rounds):
            times: dict[tuple[str, bool], list[float]] = {key: [] for key in sides}
            for k in range(args.steps):
                shift = (r * args.steps + k) % len(order)
                for key in order[shift:] + order[:shift]:
                    times[key].append(step_seconds(sides[key], step))
                step += 1
            for key in sides:
                rounds[key].append(flops_per_step / statistics.median(times[key]) / 1e12)
        return {key: statistics.median(values) for key, values in rounds.items()}
    finally:
        for run in runs:
            run.close()
        shutdown()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="meshrun-roofline-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "data"
        prepare(_quick.stdlib_text(quick=args.quick), data_dir)
        steps = 2 + args.rounds * args.steps + 1
        modes = [MODES[mode] for mode in args.modes]
        cfgs = {(m, c): make_config(m, tmp, data_dir, compiled=c, steps=steps) for m in args.models for c in modes}
        peaks = matmul_peaks({m: cfgs[(m, False)] for m in args.models}, args.squares)
        results = {m: measure({c: cfgs[(m, c)] for c in modes}, data_dir, args) for m in args.models}
    print(f"\nmodel TFLOP/s and fraction of the fp32 matmul peak ({peaks['fp32']:.3f} TFLOP/s), fp32, medians")
    print(f"{'model':>8} {'mode':>9} {'meshrun':>9} {'hand':>9} {'frac mr':>8} {'frac hand':>9} {'mr/hand':>8}")
    ok = True
    for model, r in results.items():
        for compiled in modes:
            mine, hand = r[("meshrun", compiled)], r[("hand", compiled)]
            ok &= mine / hand >= HAND_TARGET
            mode = "compiled" if compiled else "eager"
            fractions = f"{mine / peaks['fp32']:>8.1%} {hand / peaks['fp32']:>9.1%}"
            print(f"{model:>8} {mode:>9} {mine:>9.4f} {hand:>9.4f} {fractions} {mine / hand:>8.3f}")
    both = sorted(modes) == [False, True]
    for model, r in results.items() if both else ():
        speedup = r[("meshrun", True)] / r[("meshrun", False)]
        print(f"{model}: compiled / eager (meshrun) {speedup:.3f}x")
        ok &= speedup >= COMPILE_TARGET or model != "larger"
    print(
        f"{'PASS' if ok else 'FAIL'}: targets meshrun/hand >= {HAND_TARGET} in {' and '.join(args.modes)}, "
        + (f"compiled/eager >= {COMPILE_TARGET} on the larger model" if both else "compiled/eager not measured")
    )
    return _quick.exit_code(ok, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
