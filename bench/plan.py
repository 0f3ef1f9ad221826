"""How accurate is `meshrun plan`? Per-rank memory, step time and ranking, predicted vs measured.

    python bench/plan.py [--rounds 2] [--steps 20] [--log-interval 5] [--calibration-rounds 2] [--timeout 900]
    python bench/plan.py --quick    # seconds: the GPT calibrated once, two layouts (one rank, pp=2), 4 steps

1. `meshrun plan --calibrate` (the real CLI) on this machine, once per model (the bench GPT and a
   tiny Hugging Face Llama), saved to temporary calibration files (one thread, like every worker
   below): one-rank probes, then two-rank probes, in alternating rounds, medians. It also measures
   the per-step and per-message floors and a rank's memory before its model (the runtime baseline).
2. Every layout below runs through `meshrun train` (OMP_NUM_THREADS=1 per process: one CPU core
   is one "device"), in alternating rounds: a run's step time is the median of its logged windows
   after the first, a layout's the median over the rounds; its memory per pipeline stage is the
   run's `memory_gb/stage{s}` (the peak resident set size of the stage's ranks).
3. The planner predicts each layout from its model's calibration. Memory: per pp rank, the sum of
   its named terms (parameters, gradients, optimizer, in-flight activations, communication buffers,
   the calibrated runtime baseline) against the measured peak RSS. What is measured on a CPU is the
   whole process (torch, Python, data loader, allocator slack), so the runtime baseline dominates a
   tiny model's total: the tensor terms alone are checked exactly / within 10% against saved-tensor
   hooks by tests/planner/test_memory_model.py. Time: step-time MAPE. Ranking: the share of layout
   pairs ordered alike (pairs whose measured medians are within --tie are ties, left out).
Targets on this CPU: memory within 10% on every rank, MAPE <= 15%, ranking >= 85%. The load
averages (`os.getloadavg`) are printed: other users' processes take the cores the layouts share.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
from pipeline import log
from pipeline import run as launch

GPT = {
    "model.num_layers": 4,
    "model.dim": 64,
    "model.num_heads": 4,
    "model.seq_len": 64,
    "model.dropout": 0.0,
    "train.global_batch": 8,
    "precision": "fp32",
}
LLAMA = {
    "model.hf_config": (
        "{model_type: llama, hidden_size: 64, intermediate_size: 172, num_hidden_layers: 4, num_attention_heads: 4, "
        "num_key_value_heads: 2, vocab_size: 2048, max_position_embeddings: 128, tie_word_embeddings: false}"
    ),
    "model.seq_len": 64,
    "train.global_batch": 8,
    "precision": "fp32",
}
MODELS = {"gpt": GPT, "llama": LLAMA}
LAYOUTS = {  # name -> (model, dp, pp, dp_mode, schedule, micro_batch, recompute)
    "1 rank, mb 8": ("gpt", 1, 1, "ddp", "1f1b", 8, "none"),
    "1 rank, mb 2": ("gpt", 1, 1, "ddp", "1f1b", 2, "none"),
    "1 rank, mb 4, full": ("gpt", 1, 1, "ddp", "1f1b", 4, "full"),
    "dp2, mb 4": ("gpt", 2, 1, "ddp", "1f1b", 4, "none"),
    "dp2, mb 1": ("gpt", 2, 1, "ddp", "1f1b", 1, "none"),
    "dp2 fsdp, mb 2": ("gpt", 2, 1, "fsdp", "1f1b", 2, "none"),
    "dp2, mb 2, every:2": ("gpt", 2, 1, "ddp", "1f1b", 2, "every:2"),
    "pp2 1f1b, mb 1": ("gpt", 1, 2, "ddp", "1f1b", 1, "none"),
    "pp2 gpipe, mb 2": ("gpt", 1, 2, "ddp", "gpipe", 2, "none"),
    "pp2 interleaved, mb 1": ("gpt", 1, 2, "ddp", "interleaved-1f1b", 1, "none"),
    "pp2 1f1b, mb 2, full": ("gpt", 1, 2, "ddp", "1f1b", 2, "full"),
    "pp4 1f1b, mb 1": ("gpt", 1, 4, "ddp", "1f1b", 1, "none"),
    "llama 1 rank, mb 4": ("llama", 1, 1, "ddp", "1f1b", 4, "none"),
    "llama pp2 1f1b, mb 2": ("llama", 1, 2, "ddp", "1f1b", 2, "none"),
}


def layout_settings(
    model: str, dp: int, pp: int, dp_mode: str, schedule: str, micro_batch: int, recompute: str
) -> dict[str, object]:
    return {
        **MODELS[model],
        "parallel.dp": dp,
        "parallel.pp": pp,
        "parallel.dp_mode": dp_mode,
        "parallel.schedule": schedule,
        "train.micro_batch": micro_batch,
        "recompute": recompute,
    }


def measure(tmp: Path, data: Path, layout: tuple, args: argparse.Namespace, run: str) -> tuple[float, list[float]]:
    """One `meshrun train` run of the layout: the median step time of its windows after the first,
    and each pipeline stage's peak memory (bytes)."""
    run_dir = tmp / f"run-{run}"
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
    launch(
        [sys.executable, "-m", "meshrun", "train", *(f"--set={k}={v}" for k, v in settings.items())],
        timeout=args.timeout,
        cwd=tmp,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [row for row in rows if "step_time_s" in row][1:]  # the first window warms up
    stages = sorted((k for k in timed[-1] if k.startswith("memory_gb/stage")), key=lambda k: int(k.rsplit("e", 1)[1]))
    memory = [max(row[k] for row in timed) * 1e9 for k in stages] or [max(row["memory_gb"] for row in timed) * 1e9]
    return statistics.median(row["step_time_s"] for row in timed), memory


def loads() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def predict_all(
    layouts: dict[str, tuple], calibrations: dict[str, Path], log_interval: int
) -> dict[str, tuple[float, list[int]]]:
    """Each layout's predicted step time (logged every `log_interval` steps, as measured) and
    per-pp-rank memory, from its model's calibration."""
    from meshrun.config.schema import load_config
    from meshrun.planner.calibrate import load_calibration
    from meshrun.planner.cost import Hardware
    from meshrun.planner.search import predict

    hw = Hardware("cpu", float("inf"), None, intra_gbs=10.0, inter_gbs=1.25, gpus_per_node=4)
    out = {}
    for name, layout in layouts.items():
        _, eff = load_calibration(calibrations[layout[0]])
        settings = {**layout_settings(*layout), "train.log_interval": log_interval}
        cfg = load_config(None, [f"{k}={v}" for k, v in settings.items()])
        prediction = predict(cfg, hw, eff, precision="fp32", margin=0.0)
        out[name] = (prediction.time.total, [rank.total for rank in prediction.ranks])
    return out


def calibrate(tmp: Path, calibration: Path, model: str, args: argparse.Namespace) -> None:
    settings = {**MODELS[model], "parallel.dp": 1, "parallel.pp": 1}
    argv = [sys.executable, "-m", "meshrun", "plan", "--calibrate", f"--calibration={calibration}"]
    argv += [f"--rounds={args.calibration_rounds}", *(f"--set={k}={v}" for k, v in settings.items())]
    print(launch(argv, timeout=args.timeout, cwd=tmp), end="")


def measure_rounds(
    tmp: Path, data: Path, layouts: dict[str, tuple], args: argparse.Namespace
) -> dict[str, list[tuple[float, list[float]]]]:
    """Every layout once per round, in the same order, for --rounds rounds."""
    per_round: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in layouts}
    for round_ in range(args.rounds):
        for index, (name, layout) in enumerate(layouts.items()):
            log(f"round {round_ + 1}/{args.rounds}: {name} (load {loads()})")
            per_round[name].append(measure(tmp, data, layout, args, f"{index}-{round_}"))
    return per_round


def memory_report(predicted: dict[str, tuple[float, list[int]]], per_round: dict) -> float:
    """Per pp rank: predicted bytes (named terms + runtime baseline) vs the measured peak RSS;
    returns the worst relative error."""
    print(f"\n{'layout':<24}{'pp rank':>8}{'predicted MB':>14}{'measured MB':>13}{'error':>8}")
    worst = 0.0
    for name in per_round:
        measured = [statistics.median(mem[s] for _, mem in per_round[name]) for s in range(len(per_round[name][0][1]))]
        for rank, (want, got) in enumerate(zip(predicted[name][1], measured)):
            error = want / got - 1
            worst = max(worst, abs(error))
            print(f"{name:<24}{rank:>8}{want / 1e6:>14.1f}{got / 1e6:>13.1f}{error:>8.1%}")
    print(f"memory: worst error over every rank {worst:.1%} (target <= 10%): {'PASS' if worst <= 0.10 else 'FAIL'}")
    return worst


def time_report(predicted: dict[str, float], per_round: dict[str, list[float]], tie: float) -> tuple[float, float]:
    """Prints the table, the MAPE and the pair counts; returns (MAPE, share of non-tied pairs ordered alike)."""
    measured = {name: statistics.median(times) for name, times in per_round.items()}
    by_measured = sorted(measured, key=measured.__getitem__)
    by_predicted = sorted(measured, key=predicted.__getitem__)
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
    mape = statistics.mean(abs(predicted[n] / measured[n] - 1) for n in measured)
    print(f"step time: MAPE {mape:.1%} (target <= 15%): {'PASS' if mape <= 0.15 else 'FAIL'}")
    pairs = list(itertools.combinations(measured, 2))
    alike = {(a, b) for a, b in pairs if (predicted[a] < predicted[b]) == (measured[a] < measured[b])}
    ties = [(a, b) for a, b in pairs if abs(measured[a] - measured[b]) < tie * min(measured[a], measured[b])]
    decided = [pair for pair in pairs if pair not in ties]
    share = sum(pair in alike for pair in decided) / len(decided) if decided else 0.0
    print(f"ties (measured medians within {tie:.0%} of each other, left out of the share): {len(ties)}")
    print(f"every pair ordered alike: {len(alike)}/{len(pairs)} = {len(alike) / len(pairs):.0%}")
    print(
        f"ranking: pairs ordered alike, ties left out: {sum(pair in alike for pair in decided)}/{len(decided)} = "
        f"{share:.0%} (target >= 85%): {'PASS' if share >= 0.85 else 'FAIL'}"
    )
    return mape, share


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds over the layouts (median)")
    p.add_argument("--calibration-rounds", type=int, default=2, help="alternating rounds over the calibration probes")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=5, help="train.log_interval's default: a window's steps")
    p.add_argument("--tie", type=float, default=0.05, help="measured medians closer than this share are a tie")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), metavar="NAME")
    tiny = {"rounds": 1, "calibration_rounds": 1, "steps": 4, "log_interval": 2, "timeout": 300}
    args = _quick.parse(p, {**tiny, "layouts": ["1 rank, mb 2", "pp2 1f1b, mb 1"]})
    layouts = {name: LAYOUTS[name] for name in args.layouts}
    started = time.time()
    print(f"load averages (1, 5, 15 min) at the start: {loads()}")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        from meshrun.data.prepare import prepare

        data = tmp / "data"
        prepare(_quick.stdlib_text(quick=args.quick), data)
        calibrations = {
            model: tmp / f"calibration-{model}.json" for model in {layout[0] for layout in layouts.values()}
        }
        for model, calibration in calibrations.items():
            log(f"calibrating {model}")
            calibrate(tmp, calibration, model, args)
        print(f"load averages after calibrating: {loads()}")
        per_round = measure_rounds(tmp, data, layouts, args)
        predicted = predict_all(layouts, calibrations, args.log_interval)
    worst = memory_report(predicted, per_round)
    mape, share = time_report(
        {n: t for n, (t, _) in predicted.items()}, {n: [t for t, _ in r] for n, r in per_round.items()}, args.tie
    )
    print(f"load averages at the end: {loads()}  [{time.time() - started:.0f} s]")
    return _quick.exit_code(worst <= 0.10 and mape <= 0.15 and share >= 0.85, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
