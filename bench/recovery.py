"""Peer recovery's terms on gloo (issue 46): a rank SIGKILLed while its peer is in an all-reduce,
its replacement started, the group rebuilt with it and the state copied from the survivor, timed
term by term through meshrun.parallel.regroup, the path training takes.

Two processes share a TCPStore this process hosts (the job's store outlives any worker). Each round:
both join generation 0 and all-reduce in a loop; this process SIGKILLs rank 1 and starts its
replacement at once (what launcher/keeper.py does); the survivor notices, tears the group down,
joins generation 1 with the replacement and broadcasts the state to it. Terms, medians of rounds:

- detect: from the SIGKILL to the survivor's all-reduce raising (a killed peer: its socket reset;
  a hung one would take the group's timeout instead);
- tear down: `destroy_process_group` of the broken group;
- copy: the state broadcast from the survivor, once both are in generation 1;
- recovered: from the SIGKILL to the replacement holding the state, the whole path: its terms
  overlap, and the replacement's start (a process + `import torch`, seconds on a loaded 2-core
  machine) is most of it; a warm spare would remove that.

The state is the default job's per rank: weights and AdamW's two moments of one dp2 x pp2 rank's
stage, fp32. Each round runs twice, the replacement started when the rank is killed and started
ahead (a spare: `launcher/keeper.py --spare`). Verdict: recovered with a spare <= 5 s (the issue's
target for the whole recovery, of which the first step after it is not counted here).

    python bench/recovery.py                 # 3 rounds, the default job's state
    python bench/recovery.py --state-mb 256  # a larger state
    python bench/recovery.py --quick         # one round, 1 MB
    python bench/recovery.py --train         # the wired path: `meshrun train`, launch.recovery peer
    python bench/recovery.py --goodput 30    # goodput, one failure every 30 min: peer vs checkpoint restart

`--train` measures what a user gets: the default job as it is (dp2 x pp2, 1F1B), `launch.recovery:
peer`, rank 1's worker (stage 0) SIGKILLed once a step is logged; from the SIGKILL to the next step's
line on the console (the step trained again included), with the recovery's own split from its
metrics.jsonl event (until the replacement joined: detection, tear-down and its start; its model
built and the state copied) and the step trained again, with and without `launch.warm_spare`.

`--goodput MINUTES` prices what a failure every MINUTES costs each recovery (meshrun/metrics/goodput.py:
the share of wall time kept as training): two `meshrun train` runs of the default job at dp2 x pp1,
each with a checkpoint every GOODPUT_INTERVAL steps and rank 1's worker SIGKILLed once a step is
logged, one under launch.recovery peer (a warm spare), one under launch.recovery checkpoint (torchrun
restarts every worker from the newest checkpoint). Every term is read from the runs' own
metrics.jsonl: the step and save times, each recovery from the logged step before it to training
again. Here and not in `meshrun report`: the comparison needs both kinds measured on the same job
and machine, and one run folder holds one kind.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path
import torch
import torch.distributed as dist

from meshrun.launcher.keeper import FIRST, ROLE_ENV
from meshrun.metrics.goodput import measured
from meshrun.metrics.record import read_metrics_rows
from meshrun.parallel import regroup

TIMEOUT = timedelta(seconds=60)
TARGET_S = 5.0
RANKS = 2
GOODPUT_INTERVAL = 10  # checkpoint.interval of the --goodput runs


def default_state_bytes() -> int:
    """Weights + AdamW's two moments of the default job's largest rank (rank_bytes counts the
    gradients too: 4 values per parameter, 3 of them sent). Imported here: not in every worker."""
    from meshrun.config.schema import load_config
    from meshrun.planner.model_size import model_size, rank_bytes

    cfg = load_config(None)
    return max(rank_bytes(cfg, model_size(cfg.model))) * 3 // 4


def worker(rank: int, number: int, port: int, numel: int, said: Queue, turn: Event) -> None:
    """Rank `rank` joining generation `number`: the survivor-to-be all-reduces until its peer is
    lost, then recovers; a replacement (number 1) recovers once it is its `turn` and receives."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    state = [torch.full((numel,), float(rank == 0))]
    if number == 1:
        turn.wait()  # a spare started ahead waits here; a replacement started when needed finds it set
        number = regroup.awaited_generation(store, timeout=TIMEOUT)
        regroup.recover(store, state, number=number, rank=rank, world=RANKS, timeout=TIMEOUT, holds=False)
        said.put(("recovered", time.time()))
        assert bool((state[0] == 1).all()), "the replacement did not receive the survivor's state"
        return regroup.tear_down()
    regroup.join(store, number=0, rank=rank, world=RANKS, timeout=TIMEOUT)
    said.put(("ready", rank))
    while True:
        try:
            dist.all_reduce(torch.ones(16))
        except RuntimeError as broken:
            if not regroup.lost_peer(broken):
                raise
            break
    said.put(("detected", time.time()))
    started = time.monotonic()
    regroup.tear_down()
    said.put(("tear down", time.monotonic() - started))
    regroup.join(store, number=regroup.next_generation(store, lost=0), rank=rank, world=RANKS, timeout=TIMEOUT)
    started = time.monotonic()
    regroup.copy_from_replica(state, holds=True)
    said.put(("copy", time.monotonic() - started))
    regroup.tear_down()


def one_round(numel: int, *, spare: bool) -> dict[str, float]:
    """The terms of one SIGKILL and recovery, in seconds; `spare`: the replacement started ahead
    (launcher/keeper.py --spare), else when the rank is killed."""
    context = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    said, turn = context.Queue(), context.Event()
    first = [context.Process(target=worker, args=(rank, 0, store.port, numel, said, turn)) for rank in range(RANKS)]
    replacement = context.Process(target=worker, args=(1, 1, store.port, numel, said, turn))
    for proc in [*first, *[replacement] * spare]:
        proc.start()
    for _ in range(RANKS):
        assert said.get(timeout=TIMEOUT.total_seconds())[0] == "ready"
    time.sleep(0.2)  # both in the all-reduce loop
    killed_at = time.time()
    os.kill(first[1].pid, signal.SIGKILL)
    turn.set()
    if not spare:
        replacement.start()
    terms = dict(said.get(timeout=TIMEOUT.total_seconds()) for _ in range(4))
    for proc in (*first, replacement):
        proc.join(timeout=TIMEOUT.total_seconds())
        if proc.exitcode not in (0, -signal.SIGKILL):
            raise SystemExit(f"a worker ended with {proc.exitcode}")
    return {
        "detect": terms["detected"] - killed_at,
        "tear down": terms["tear down"],
        "copy": terms["copy"],
        "recovered": terms["recovered"] - killed_at,
    }


def train_round(folder: Path, *, spare: bool, steps: int = 40, kill_after: int = 20) -> dict[str, float]:
    """One `meshrun train` of the default job (dp2 x pp2) under peer recovery, rank 1 killed after
    step `kill_after`: seconds from the SIGKILL to the next step's line, and the event's split."""
    run = folder / f"run-{'spare' if spare else 'cold'}"
    sets = {
        "launch.recovery": "peer", "launch.max_restarts": 1, "launch.warm_spare": spare,
        "run_dir": run, "train.steps": steps, "train.log_interval": 1, "train.eval_interval": 0,
        "checkpoint.interval": 0, "tracker.mode": "disabled", "metrics.plots": False,
    }  # fmt: skip
    args = [sys.executable, "-P", "-m", "meshrun", "train", *(f"--set={k}={v}" for k, v in sets.items())]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=folder, start_new_session=True)
    assert proc.stderr is not None
    killed_at = next_step_at = 0.0
    for line in proc.stderr:
        if line.startswith(f"[meshrun] step {kill_after}/") and not killed_at:
            os.kill(first_worker(proc.pid, rank=1), signal.SIGKILL)
            killed_at = time.time()
        elif line.startswith(f"[meshrun] step {kill_after + 1}/") and killed_at:
            next_step_at = time.time()
    if proc.wait() != 0 or not next_step_at:
        raise SystemExit(f"the run in {run} failed or never logged step {kill_after + 1}: see its logs/")
    event = next(row for row in map(json.loads, (run / "metrics.jsonl").open()) if "recovery_s" in row)
    return {
        "to next step": next_step_at - killed_at,
        "rejoined": event["rejoin_s"],
        "model+state": event["state_s"],
        "step again": next_step_at - killed_at - event["recovery_s"],
    }


def first_worker(launcher: int, *, rank: int, role: str | None = FIRST) -> int:
    """The pid of `rank`'s first training worker under `launcher` (its keeper's child, not the spare;
    `role` None: a worker torchrun started itself, no keeper's)."""
    for pid in Path("/proc").iterdir():
        try:
            raw = (pid / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        environ = dict(kv.split("=", 1) for kv in raw if "=" in kv)
        if environ.get("RANK") == str(rank) and environ.get(ROLE_ENV) == role and launcher in ancestors(int(pid.name)):
            return int(pid.name)
    raise SystemExit(f"no worker of rank {rank} found under {launcher}")


def ancestors(pid: int) -> list[int]:
    """`pid`'s parent, its parent, ... up to init (another job's workers are not this launcher's)."""
    found = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
        found.append(pid)
    return found


def train_main(rounds: int) -> int:
    """--train: the wired path, medians of `rounds` (each: a cold replacement and a warm spare)."""
    with tempfile.TemporaryDirectory(prefix="meshrun-recovery-") as folder:
        done = [{spare: train_round(Path(folder), spare=spare) for spare in (False, True)} for _ in range(rounds)]
    print(f"the default job (dp2 x pp2), launch.recovery peer; medians of {rounds} rounds, seconds:")
    warm = print_medians(done, spare_name="launch.warm_spare")[True]["to next step"]
    print(
        f"{'PASS' if warm <= TARGET_S else 'FAIL'}: SIGKILL -> next step {warm:.2f} s with a warm spare (target <= {TARGET_S:.0f} s)"
    )
    return 0 if warm <= TARGET_S else 1


def killed_run(folder: Path, *, recovery: str, steps: int, kill_after: int) -> list[dict]:
    """One `meshrun train` of the default job at dp2 x pp1, a checkpoint every GOODPUT_INTERVAL steps,
    rank 1's worker SIGKILLed once step `kill_after` is logged, recovered by `recovery`; its
    metrics.jsonl rows."""
    run = folder / f"run-{recovery}"
    sets = {
        "parallel.pp": 1, "launch.recovery": recovery, "launch.max_restarts": 1, "run_dir": run,
        "launch.warm_spare": recovery == "peer", "train.steps": steps, "train.log_interval": 1,
        "train.eval_interval": 0, "checkpoint.interval": GOODPUT_INTERVAL, "tracker.mode": "disabled",
        "metrics.plots": False,
    }  # fmt: skip
    args = [sys.executable, "-P", "-m", "meshrun", "train", *(f"--set={k}={v}" for k, v in sets.items())]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=folder, start_new_session=True)
    assert proc.stderr is not None
    killed = False
    for line in proc.stderr:
        if line.startswith(f"[meshrun] step {kill_after}/") and not killed:
            os.kill(first_worker(proc.pid, rank=1, role=FIRST if recovery == "peer" else None), signal.SIGKILL)
            killed = True
    if proc.wait() != 0 or not killed:
        raise SystemExit(f"the run in {run} failed or never logged step {kill_after}: see its logs/")
    return read_metrics_rows(run / "metrics.jsonl")


def goodput_main(every_min: float, *, quick: bool) -> int:
    """--goodput: both recoveries measured once, and each one's goodput at one failure every `every_min`."""
    steps, kill_after = (16, 13) if quick else (40, 25)  # the kill: past a checkpoint, before the next
    with tempfile.TemporaryDirectory(prefix="meshrun-goodput-") as folder:
        runs = {
            kind: killed_run(Path(folder), recovery=kind, steps=steps, kill_after=kill_after)
            for kind in ("peer", "checkpoint")
        }
    terms = measured(runs["peer"], runs["checkpoint"], interval=GOODPUT_INTERVAL)
    print(
        f"the default job's model at dp2 x pp1, a checkpoint every {terms.interval} steps, rank 1 SIGKILLed after "
        f"step {kill_after}; measured: step {terms.step_s:.3f} s, save {terms.save_s:.3f} s, peer recovery "
        f"{terms.peer_s:.2f} s, checkpoint restart {terms.restart_s:.2f} s (each from the loss to training again)"
    )
    every_s = every_min * 60
    print(
        f"  goodput with no failure: {terms.goodput(math.inf, peer=True):.2%} (the checkpoint saves' share is the rest)"
    )
    for name, peer in (("peer recovery", True), ("checkpoint restart", False)):
        print(f"  goodput, one failure every {every_min:g} min, {name}: {terms.goodput(every_s, peer=peer):.2%}")
    return 0


def print_medians(rounds: list[dict[bool, dict[str, float]]], *, spare_name: str) -> dict[bool, dict[str, float]]:
    """A table of each term's median over `rounds`, without and with a spare; returns the medians."""
    print(f"  {'replacement':22s}" + "".join(f"{term:>14s}" for term in rounds[0][False]))
    medians = {}
    for spare, name in ((False, "started when needed"), (True, spare_name)):
        medians[spare] = {term: statistics.median(r[spare][term] for r in rounds) for term in rounds[0][spare]}
        print(f"  {name:22s}" + "".join(f"{seconds:14.3f}" for seconds in medians[spare].values()))
    return medians


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--state-mb", type=float, default=None, help="state per rank (default: the default job's)")
    p.add_argument("--train", action="store_true", help="the wired path: `meshrun train` under launch.recovery peer")
    p.add_argument("--goodput", type=float, metavar="MINUTES", help="goodput with one failure every MINUTES")
    args = _quick.parse(p, {"rounds": 1, "state_mb": 1.0}, argv)
    if args.goodput is not None:
        return goodput_main(args.goodput, quick=args.quick)
    if args.train:
        return train_main(args.rounds)
    state_bytes = default_state_bytes() if args.state_mb is None else int(args.state_mb * 2**20)
    rounds = [{spare: one_round(state_bytes // 4, spare=spare) for spare in (False, True)} for _ in range(args.rounds)]
    print(f"state per rank: {state_bytes / 2**20:.1f} MB; medians of {args.rounds} rounds, seconds:")
    medians = print_medians(rounds, spare_name="a spare started ahead")
    cold, warm = medians[False]["recovered"], medians[True]["recovered"]
    passed = warm <= TARGET_S
    verdict = "PASS" if passed else "FAIL"
    print(
        f"{verdict}: SIGKILL -> state copied {warm:.2f} s with a spare, {cold:.2f} s without (target <= {TARGET_S:.0f} s)"
    )
    return _quick.exit_code(passed, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
