"""Does `meshrun plan` rank layouts the way real runs do? (issue 12's step-time proof)

    python bench/plan.py [--steps 6] [--log-interval 2] [--timeout 900]

1. `meshrun plan --calibrate` (the real CLI) on this machine with the bench model, saved to a
   temporary calibration file (one thread, like every worker below).
2. Every layout below runs through `meshrun train` (OMP_NUM_THREADS=1 per process: one CPU core
   is one "device"); measured step time = the fastest window's `step_time_s` after the first
   window (on a shared machine other processes only add time).
3. The planner predicts each layout's step time from the calibration (the schedules' bubble
   formulas, not the runs' measured bubbles); the verdict is the share of layout pairs that the
   prediction orders the same way as the measurement. Target: >= 80%.
"""

from __future__ import annotations

import argparse
import itertools
import json
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


def measure(tmp: Path, data: Path, name: str, layout: tuple, args: argparse.Namespace) -> float:
    run_dir = tmp / f"run-{list(LAYOUTS).index(name)}"
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
    timed = [row for row in rows if "step_time_s" in row][1:]
    return min(row["step_time_s"] for row in timed)  # others' processes only add time: the fastest window


def predict_all(calibration: Path) -> dict[str, float]:
    from meshrun.config import load_config
    from meshrun.planner.calibrate import load
    from meshrun.planner.cost import Hardware
    from meshrun.planner.search import predict

    _, eff = load(calibration)
    hw = Hardware("cpu", float("inf"), None, intra_gbs=10.0, inter_gbs=1.25, gpus_per_node=2)
    out = {}
    for name, layout in LAYOUTS.items():
        cfg = load_config(None, [f"{k}={v}" for k, v in layout_settings(*layout).items()])
        out[name] = predict(cfg, hw, eff, precision="fp32", margin=0.0).time.total
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--log-interval", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        from meshrun.data.prepare import prepare

        data = tmp / "data"
        prepare([str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")], data)
        calibration = tmp / "calibration.json"
        log("calibrating")
        print(
            run(
                [
                    sys.executable,
                    "-m",
                    "meshrun",
                    "plan",
                    "--calibrate",
                    f"--calibration={calibration}",
                    *(f"--set={k}={v}" for k, v in {**MODEL, "parallel.dp": 1, "parallel.pp": 1}.items()),
                ],
                timeout=args.timeout,
                cwd=tmp,
            ),
            end="",
        )
        measured = {}
        for name, layout in LAYOUTS.items():
            log(f"running {name}")
            measured[name] = measure(tmp, data, name, layout, args)
        predicted = predict_all(calibration)
    pairs = list(itertools.combinations(LAYOUTS, 2))
    agree = sum((predicted[a] < predicted[b]) == (measured[a] < measured[b]) for a, b in pairs)
    by_measured = sorted(LAYOUTS, key=measured.get)
    by_predicted = sorted(LAYOUTS, key=predicted.get)
    print(f"\n{'layout':<24}{'predicted s':>12}{'measured s':>12}{'ratio':>7}{'pred rank':>10}{'meas rank':>10}")
    for name in by_measured:
        print(
            f"{name:<24}{predicted[name]:>12.4f}{measured[name]:>12.4f}{predicted[name] / measured[name]:>7.2f}"
            f"{by_predicted.index(name) + 1:>10}{by_measured.index(name) + 1:>10}"
        )
    share = agree / len(pairs)
    print(
        f"\npairs ordered alike: {agree}/{len(pairs)} = {share:.0%} (target >= 80%): {'PASS' if share >= 0.8 else 'FAIL'}"
        f"  [{time.time() - started:.0f} s]"
    )
    return 0 if share >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
