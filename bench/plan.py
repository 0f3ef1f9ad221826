"""Does `meshrun plan` rank layouts the way real runs do? (issue 12's step-time proof)

    python bench/plan.py [--rounds 3] [--steps 6] [--log-interval 2] [--calibration-rounds 3] [--timeout 900]

1. `meshrun plan --calibrate` (the real CLI) on this machine with the bench model, saved to a
   temporary calibration file (one thread, like every worker below): one-rank probes, then two-rank
   probes (dp=2, pp=2 1F1B at two microbatch counts), in alternating rounds, medians.
2. Every layout below runs through `meshrun train` (OMP_NUM_THREADS=1 per process: one CPU core
   is one "device"), in alternating rounds (every layout once, then again): a run's step time is
   the median of its logged windows after the first, a layout's the median over the rounds.
3. The planner predicts each layout's step time from the calibration (the schedules' bubble
   formulas, not the runs' measured bubbles); the verdict is the share of layout pairs that the
   prediction orders the same way as the measurement. Target: >= 80%. Pairs whose measured
   medians differ by less than --tie (default 5%, about the noise of a shared machine) are ties:
   reported apart and left out of the share (the share over every pair is printed too).
The load averages (`os.getloadavg`) are printed before and after: other users' processes take
the cores the layouts compete for.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from pipeline import log, run

MODEL = {
    "model.num_layers": 4,
    "model.dim": 64,
    "model.num_heads": 4,
    "model.seq_len": 64,
    "model.dropout": 0.0,
    "train.global_batch": 8,
    "precision": "fp32",
}
LAYOUTS = {  # name -> (dp, pp, schedule, micro_batch, recompute)
    "1 rank, mb 8": (1, 1, "1f1b", 8, "none"),
    "1 rank, mb 2": (1, 1, "1f1b", 2, "none"),
    "1 rank, mb 4, full": (1, 1, "1f1b", 4, "full"),
    "dp2, mb 4": (2, 1, "1f1b", 4, "none"),
    "dp2, mb 1": (2, 1, "1f1b", 1, "none"),
    "pp2 1f1b, mb 1": (1, 2, "1f1b", 1, "none"),
    "pp2 gpipe, mb 2": (1, 2, "gpipe", 2, "none"),
    "pp2 interleaved, mb 1": (1, 2, "interleaved-1f1b", 1, "none"),
    "pp2 1f1b, mb 2, full": (1, 2, "1f1b", 2, "full"),
}


def layout_settings(dp: int, pp: int, schedule: str, micro_batch: int, recompute: str) -> dict[str, object]:
    return {
        **MODEL,
        "parallel.dp": dp,
        "parallel.pp": pp,
        "parallel.schedule": schedule,
        "train.micro_batch": micro_batch,
        "recompute": recompute,
    }


def measure(tmp: Path, data: Path, name: str, layout: tuple, args: argparse.Namespace, round_: int) -> float:
    """One `meshrun train` run of the layout: the median step time of its windows after the first."""
    run_dir = tmp / f"run-{list(LAYOUTS).index(name)}-{round_}"
    settings = {
        **layout_settings(*layout),
        "data.dir": data,
        "run_dir": run_dir,
        "train.steps": args.steps,
        "train.log_interval": args.log_interval,
        "train.eval_interval": 0,
        "tracker.mode": "disabled",
        "checkpoint.at_end": "false",
    }
    run(
        [sys.executable, "-m", "meshrun", "train", *(f"--set={k}={v}" for k, v in settings.items())],
        timeout=args.timeout,
        cwd=tmp,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [row for row in rows if "step_time_s" in row][1:]  # the first window warms up
    return statistics.median(row["step_time_s"] for row in timed)


def loads() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def predict_all(calibration: Path) -> dict[str, float]:
    from meshrun.config.schema import load_config
    from meshrun.planner.calibrate import load_calibration
    from meshrun.planner.cost import Hardware
    from meshrun.planner.search import predict

    _, eff = load_calibration(calibration)
    hw = Hardware("cpu", float("inf"), None, intra_gbs=10.0, inter_gbs=1.25, gpus_per_node=2)
    out = {}
    for name, layout in LAYOUTS.items():
        cfg = load_config(None, [f"{k}={v}" for k, v in layout_settings(*layout).items()])
        out[name] = predict(cfg, hw, eff, precision="fp32", margin=0.0).time.total
    return out


def calibrate(tmp: Path, calibration: Path, args: argparse.Namespace) -> None:
    settings = {**MODEL, "parallel.dp": 1, "parallel.pp": 1}
    argv = [sys.executable, "-m", "meshrun", "plan", "--calibrate", f"--calibration={calibration}"]
    argv += [f"--rounds={args.calibration_rounds}", *(f"--set={k}={v}" for k, v in settings.items())]
    print(run(argv, timeout=args.timeout, cwd=tmp), end="")


def measure_rounds(tmp: Path, data: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Every layout once per round, in the same order, for --rounds rounds."""
    per_round: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for round_ in range(args.rounds):
        for name, layout in LAYOUTS.items():
            log(f"round {round_ + 1}/{args.rounds}: {name} (load {loads()})")
            per_round[name].append(measure(tmp, data, name, layout, args, round_))
    return per_round


def report(predicted: dict[str, float], per_round: dict[str, list[float]], tie: float) -> float:
    """Prints the table and the pair counts; returns the share of non-tied pairs ordered alike."""
    measured = {name: statistics.median(times) for name, times in per_round.items()}
    by_measured = sorted(LAYOUTS, key=measured.__getitem__)
    by_predicted = sorted(LAYOUTS, key=predicted.__getitem__)
    print(
        f"\n{'layout':<24}{'predicted s':>12}{'measured s':>12}{'ratio':>7}{'pred rank':>10}{'meas rank':>10}"
        "  rounds (s)"
    )
    for name in by_measured:
        print(
            f"{name:<24}{predicted[name]:>12.4f}{measured[name]:>12.4f}{predicted[name] / measured[name]:>7.2f}"
            f"{by_predicted.index(name) + 1:>10}{by_measured.index(name) + 1:>10}  "
            + " ".join(f"{t:.4f}" for t in per_round[name])
        )
    pairs = list(itertools.combinations(LAYOUTS, 2))
    alike = {(a, b) for a, b in pairs if (predicted[a] < predicted[b]) == (measured[a] < measured[b])}
    ties = [(a, b) for a, b in pairs if abs(measured[a] - measured[b]) < tie * min(measured[a], measured[b])]
    decided = [pair for pair in pairs if pair not in ties]
    share = sum(pair in alike for pair in decided) / len(decided) if decided else 0.0
    print(f"\nties (measured medians within {tie:.0%} of each other, left out of the share): {len(ties)}")
    for a, b in ties:
        print(f"  {a} ~ {b} ({'ordered alike' if (a, b) in alike else 'ordered apart'} by the prediction)")
    print(f"every pair ordered alike: {len(alike)}/{len(pairs)} = {len(alike) / len(pairs):.0%}")
    print(
        f"pairs ordered alike, ties left out: {sum(pair in alike for pair in decided)}/{len(decided)} = {share:.0%} "
        f"(target >= 80%): {'PASS' if share >= 0.8 else 'FAIL'}"
    )
    return share


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds over the layouts (median)")
    p.add_argument("--calibration-rounds", type=int, default=3, help="alternating rounds over the calibration probes")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--log-interval", type=int, default=2)
    p.add_argument("--tie", type=float, default=0.05, help="measured medians closer than this share are a tie")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    started = time.time()
    print(f"load averages (1, 5, 15 min) at the start: {loads()}")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        from meshrun.data.prepare import prepare

        data = tmp / "data"
        prepare([str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")], data)
        calibration = tmp / "calibration.json"
        log("calibrating")
        calibrate(tmp, calibration, args)
        print(f"load averages after calibrating: {loads()}")
        per_round = measure_rounds(tmp, data, args)
        predicted = predict_all(calibration)
    share = report(predicted, per_round, args.tie)
    print(f"load averages at the end: {loads()}  [{time.time() - started:.0f} s]")
    return 0 if share >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
