"""`meshrun parity`: one job in two layouts, trained one after the other by real `meshrun train`
launches into two new run directories, from the same weights (the seed, per layer) on the same
global batches (the seed and the batch size decide them, not the layout), then compared step by
step and tensor by tensor (metrics/parity.py says what equal means). Arguments that need no
torch are checked first (cli/arguments.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from meshrun.checkpoint.paths import complete_checkpoints, step_of
from meshrun.config.schema import Config, load_config
from meshrun.errors import ConfigError, RunError
from meshrun.files.console import say
from meshrun.files.json_reader import read_json
from meshrun.metrics import parity
from meshrun.preflight import preflight

SIDES = ("A", "B")
# train keys that say how the work is split or logged, not what is computed: they may differ
_LAYOUT_TRAIN_KEYS = ("micro_batch", "eval_interval", "eval_batches", "log_interval")


def forced_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """What parity sets on both runs: their run_dir, N steps, every step logged to metrics.jsonl,
    no validation, no trackers or pictures, and the checkpoints the weights are compared from."""
    keys: dict[str, object] = {
        "run_dir": run_dir,
        "train.steps": args.steps,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "tracker.backends": "[jsonl]",
        "tracker.mode": "disabled",
        "metrics.plots": "false",
        "profile.steps": "[]",
        "checkpoint.at_end": str(args.weights != "none").lower(),
        "checkpoint.interval": 1 if args.weights == "every" else 0,
        "checkpoint.keep": args.steps,
    }
    if args.layers:
        keys["model.num_layers"] = args.layers
    return [f"{key}={value}" for key, value in keys.items()]


def side_arguments(args: argparse.Namespace, out: Path) -> list[tuple[str | None, list[str]]]:
    """(config file, overrides) of runs A and B: one file for both, or one each; `--set` for both,
    then `--set-a` / `--set-b`, then what parity itself sets."""
    files = [args.configs[0], args.configs[-1]] if args.configs else [None, None]
    return [
        (file, [*args.overrides, *own, *forced_overrides(args, out / side.lower())])
        for side, file, own in zip(SIDES, files, (args.set_a, args.set_b))
    ]


def _flat(section: Any, prefix: str) -> dict[str, Any]:
    if isinstance(section, dict):
        return {k: v for key, value in section.items() for k, v in _flat(value, f"{prefix}.{key}").items()}
    return {prefix: section}


def check_one_job(a: Config, b: Config) -> None:
    """Refuse two configs that differ beyond the layout: another model, data or training setting
    would make any difference expected, not a finding."""
    job = []
    for cfg in (a, b):
        dump = cfg.model_dump(mode="json")
        train = {k: v for k, v in dump["train"].items() if k not in _LAYOUT_TRAIN_KEYS}
        job.append({**_flat(dump["model"], "model"), **_flat(dump["data"], "data"), **_flat(train, "train")})
    differ = sorted(key for key in job[0].keys() | job[1].keys() if job[0].get(key) != job[1].get(key))
    if differ:
        key = differ[0]
        raise ConfigError(
            f"A and B are not one job: {key} is {job[0].get(key)!r} in A and {job[1].get(key)!r} in B"
            + (f" (and {len(differ) - 1} more keys)" if len(differ) > 1 else "")
            + "; parity compares two layouts of the same model, data and training settings"
        )


def describe(cfg: Config, precision: str | None = None) -> str:
    """One run's layout in a line: what may differ between A and B."""
    return (
        f"{cfg.layout.text()}, micro_batch {cfg.train.micro_batch}, recompute {cfg.recompute}, "
        f"{precision or cfg.precision}"
    )


def train_side(side: str, file: str | None, overrides: list[str], cfg: Config, out: Path) -> str:
    """Run `meshrun train` for one side, its output in OUT/<side>.log; returns the precision it
    resolved (its config.json). A refused config is the user's input (exit 2); a failed run, exit 1."""
    log = out / f"{side.lower()}.log"
    say(f"parity: training {side} ({describe(cfg)}) for {cfg.train.steps} steps in {cfg.run_dir}; output in {log}")
    argv = [
        sys.executable,
        "-P",
        "-m",
        "meshrun",
        "train",
        *([file] if file else []),
        *(f"--set={o}" for o in overrides),
    ]
    with log.open("w") as sink:
        code = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, check=False).returncode
    if code:
        lines = log.read_text(errors="replace").splitlines()
        reason = next((line for line in reversed(lines) if line.startswith("meshrun: error:")), f"exit code {code}")
        message = f"run {side} ({describe(cfg)}) did not finish: {reason.removeprefix('meshrun: error: ')} (see {log})"
        raise (ConfigError if code == 2 else RunError)(message)
    return str(read_json(Path(cfg.run_dir) / "config.json")["precision"])


def weight_checkpoints(run_a: Path, run_b: Path, every: bool) -> list[tuple[int, Path, Path]]:
    """(step, checkpoint of A, checkpoint of B) to compare: the final pair, or every step's."""
    saved = [{step_of(p): p for p in complete_checkpoints(run)} for run in (run_a, run_b)]
    steps = sorted(saved[0].keys() & saved[1].keys())
    return [(s, saved[0][s], saved[1][s]) for s in (steps if every else steps[-1:])]


def run_parity(args: argparse.Namespace) -> int:
    out = Path(args.out)
    sides = side_arguments(args, out)
    configs = [load_config(file, overrides) for file, overrides in sides]  # every config refused before any run
    check_one_job(*configs)
    if args.layers and configs[0].model.family == "hf":
        raise ConfigError(
            "--layers: a Hugging Face model takes its depth from its own config; "
            "set model.hf_config's num_hidden_layers with --set instead"
        )
    for side, cfg in zip(SIDES, configs):  # what `meshrun train` would refuse, before either run trains
        try:
            preflight(cfg)
        except ConfigError as exc:
            raise ConfigError(f"run {side} ({describe(cfg)}): {exc}") from None
    if describe(configs[0]) == describe(configs[1]):
        say(
            f"parity: A and B have the same layout ({describe(configs[0])}): this checks that a run repeats "
            "itself, not one layout against another; give them different layouts with --set-a / --set-b"
        )
    out.mkdir(parents=True, exist_ok=True)
    precisions = [
        train_side(side, file, overrides, cfg, out) for side, (file, overrides), cfg in zip(SIDES, sides, configs)
    ]
    name, tol = parity.tolerance_for((precisions[0], precisions[1]))
    run_a, run_b = (Path(cfg.run_dir) for cfg in configs)
    steps, missing = parity.step_diffs(run_a, run_b)
    pairs = weight_checkpoints(run_a, run_b, args.weights == "every") if args.weights != "none" else []
    weights = parity.weights_at(pairs, tol)
    text, equal = parity.report(name, tol, steps, missing, weights, every_step=args.weights == "every")
    print(f"meshrun parity, {args.steps} steps:")
    for side, cfg, precision in zip(SIDES, configs, precisions):
        print(f"  {side}: {describe(cfg, precision)} ({cfg.run_dir})")
    print(text)
    return 0 if equal else 1
