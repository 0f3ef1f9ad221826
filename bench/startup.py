"""A launch's cost before and after training: `meshrun train`, whose workers are forked from one
server that imported torch and meshrun once (meshrun.launcher.forked), against the same command
with its workers spawned, each starting Python and importing torch and meshrun itself (~2.5 s of
CPU a worker here): the fallback meshrun takes where TMPDIR is too long for the server's socket,
used here to switch forking off. torchrun started by hand (`python -m torch.distributed.run ...
-m meshrun train`, spawned workers, no launcher: no checks before the workers) is printed beside.

The job is tiny (4 steps of a 4-block d32 GPT), so a launch's wall time is almost all start and
end. Rounds alternate the ways; medians. Every run trains the same numbers (the final loss is
checked equal). Verdict: forked / spawned wall time <= 0.85 at 4 workers.

    python bench/startup.py            # 4 workers, 5 rounds
    python bench/startup.py --quick    # 2 workers, one round
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path

from meshrun.data.prepare import prepare
from meshrun.launcher.forked import LONGEST_TMPDIR, forks_under
from meshrun.launcher.torchrun import LAUNCH_TMP_PREFIX

TARGET = 0.85


def job(data: Path, run: Path, ranks: int) -> list[str]:
    settings = {
        "data.dir": data,
        "run_dir": run,
        "model.vocab_size": 256,
        "model.num_layers": 4,
        "model.dim": 32,
        "model.seq_len": 16,
        "parallel.dp": ranks // 2,
        "parallel.pp": 2,
        "train.global_batch": 8,
        "train.micro_batch": 2,
        "train.steps": 4,
        "train.eval_interval": 0,
        "precision": "fp32",
        "tracker.mode": "disabled",
        "metrics.plots": False,
        "checkpoint.interval": 0,
    }
    return ["train", *(f"--set={key}={value}" for key, value in settings.items())]


def timed(argv: list[str], run: Path, tmpdir: Path | None) -> tuple[float, float]:
    """Wall seconds of one launch (TMPDIR `tmpdir` where given) and its final loss (the run folder
    removed first)."""
    shutil.rmtree(run, ignore_errors=True)
    env = {**os.environ, **({} if tmpdir is None else {"TMPDIR": str(tmpdir)})}
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    seconds = time.perf_counter() - start
    return seconds, json.loads((run / "summary.json").read_text())["final_loss"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="workers (an even number: dp x pp2)")
    p.add_argument("--rounds", type=int, default=5)
    args = _quick.parse(p, {"ranks": 2, "rounds": 1})
    if not forks_under(os.path.join(tempfile.gettempdir(), LAUNCH_TMP_PREFIX + "12345678")):
        print(f"note: TMPDIR {tempfile.gettempdir()} is too long for the fork server: every way spawns")
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        data = work / "data"
        prepare(_quick.stdlib_text(quick=True), data, val_fraction=0.1)
        run, long_tmp = work / "run", work / ("t" * LONGEST_TMPDIR)
        long_tmp.mkdir()
        meshrun = [sys.executable, "-m", "meshrun", *job(data, run, args.ranks)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
        ways = {  # (command, TMPDIR)
            "forked (meshrun train)": (meshrun, None),
            "spawned (meshrun train, TMPDIR too long to fork)": (meshrun, long_tmp),
            "spawned (torchrun by hand, no launcher)": ([*torchrun, *meshrun[1:]], None),
        }
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        losses = set()
        for _ in range(args.rounds):
            for way, (argv, tmpdir) in ways.items():
                wall, loss = timed(argv, run, tmpdir)
                seconds[way].append(wall)
                losses.add(loss)
        for way, walls in seconds.items():
            print(f"{way}: median {statistics.median(walls):.2f} s over {len(walls)} rounds ({args.ranks} workers)")
        forked, spawned = (statistics.median(walls) for walls in list(seconds.values())[:2])
        same = len(losses) == 1
        print(f"final loss equal both ways: {same}")
        ratio = forked / spawned
        verdict = "PASS" if ratio <= TARGET and same else "FAIL"
        print(f"{verdict}: forked / spawned launch wall time median {ratio:.2f}x (target <= {TARGET})")
        return _quick.exit_code(verdict == "PASS", quick=args.quick, correct=same)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
