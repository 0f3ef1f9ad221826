"""What a lost worker leaves under launch.recovery peer (issue 46), read from real runs: a rank hung
mid-step is ended by its own watchdog alone and replaced from its peer in seconds (not the
collective's 30-min timeout), bit-identical to the same job restarted from its checkpoint (a resume is
exact; each step of both trained on the same batches); a rank killed again after its
replacements are used up ends the run with one line naming the rank and its node; `meshrun report`
shows each recovery on the loss curve and says which rank died, how, how it was recovered, the time
and the steps lost. One module-scoped launch of each (real torchrun, keepers, gloo)."""

from __future__ import annotations

import itertools
import json
import random
import re
import shutil
import socket
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import final_weights, losses, meshrun_env, meshrun_in_process, read_metrics, run_meshrun, tiny

from meshrun.metrics.compare import mark_recoveries, read_run
from meshrun.metrics.goodput import Measured, measured

HERE = Path(__file__).parent  # hanging_gpt: blocks on cue
KILLER = Path(__file__).parents[1] / "training"  # interrupting_gpt: SIGKILL on cue
STEPS = 6
HANG_TIMEOUT = 5
INTERVAL = 3  # the restarted run's checkpoint.interval
JOB = {"parallel.dp": 2, "train.steps": STEPS, "checkpoint.interval": 0, "launch.max_restarts": 1}
PEER = {"launch.recovery": "peer", "launch.warm_spare": True}


@pytest.fixture(scope="module")
def runs(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """hung (rank 1 blocks in step 3's forward, its first worker only); repeated
    (rank 1 SIGKILLed at its 5th forward in every worker: its replacement dies too); restarted
    (launch.recovery checkpoint, a checkpoint every 3 steps, rank 1 SIGKILLed in step 5); sender lost
    (rank 1 SIGKILLed in step 3, then rank 0 as it is about to send its state)."""
    tmp = tmp_path_factory.mktemp("recovery_report")
    hang = {"MESHRUN_TEST_HANG": "1:3", "MESHRUN_TEST_HANG_ONCE": str(tmp / "hung-once")}
    kill = {"MESHRUN_TEST_KILL_AT": "5", "MESHRUN_TEST_ON_RANK": "1", "MESHRUN_TEST_KILL_EVERY": "1"}
    restart = {"MESHRUN_TEST_KILL_AT": "9", "MESHRUN_TEST_ON_RANK": "1"}  # 2 forwards a step: step 5's first
    sender = {"MESHRUN_TEST_KILL_AT": "5", "MESHRUN_TEST_ON_RANK": "1", "MESHRUN_TEST_KILL_SENDING": "0"}
    done = {}
    for name, settings, env in (
        ("hung", {"model.factory": "hanging_gpt:build", "launch.hang_timeout": HANG_TIMEOUT, **PEER}, hang),
        ("repeated", {"model.factory": "interrupting_gpt:build", "launch.recovery": "peer"}, kill),
        ("restarted", {"model.factory": "interrupting_gpt:build", "checkpoint.interval": INTERVAL}, restart),
        ("sender lost", {"model.factory": "interrupting_gpt:build", "checkpoint.interval": 2, **PEER}, sender),
    ):
        run = tmp / name.replace(" ", "-")
        path = f"{HERE}:{KILLER}"
        args = ["train", *tiny(data_dir, run, **{**JOB, **settings})]
        proc = run_meshrun(args, tmp_path=tmp, env=meshrun_env(tmp, PYTHONPATH=path, **env), timeout=300, check=False)
        done[name] = run, proc
    return done


@pytest.mark.timeout(1500)  # the fixture's four launches, on loaded cores
def test_a_hung_rank_is_ended_alone_and_replaced_from_its_peer(runs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit-identical to the restarted run (the same job and data), each step once; the hang's report kept aside, under
    a name no later failure of the run is read as."""
    (plain, _), (run, done) = runs["restarted"], runs["hung"]
    assert done.returncode == 0, done.stderr
    monkeypatch.syspath_prepend(str(HERE))  # the checkpoints' model.factory
    monkeypatch.syspath_prepend(str(KILLER))
    reference, recovered = final_weights(plain), final_weights(run)
    assert all(torch.equal(recovered[name], reference[name]) for name in reference)
    rows = read_metrics(run)
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, STEPS + 1))
    assert losses(run) == losses(plain)
    assert [(e["step"], e["recovered_ranks"], e["recovered_from"]) for e in rows if "recovered_ranks" in e] == [
        (2, "1", 0)
    ]
    said = [line for line in done.stderr.splitlines() if line.startswith("[meshrun] rank 1 made no progress")]
    stacks = run / "hang" / "replaced-1-1" / "rank1.stacks.txt"
    assert len(said) == 1 and said[0].endswith(
        f"stacks: {stacks}); its spare takes over (1 of 1), which takes its state from a replica"
    ), said
    assert "block_here" in stacks.read_text() and not list((run / "hang").glob("attempt-*"))
    assert "Traceback" not in done.stderr
    assert "is a straggler" not in done.stderr  # the window holding the recovery is judged on no rank


def test_a_rank_that_keeps_failing_is_named_with_its_node(runs) -> None:
    """Its replacement killed too (launch.max_restarts 1): the last line names the rank and the node."""
    run, done = runs["repeated"]
    assert done.returncode == 137, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    host = socket.gethostname()
    assert last.startswith(
        f"meshrun: error: rank 1 on node {host} failed 2 times (was killed by SIGKILL); launch.max_restarts (1) "
        f"replacements used up: if node {host} keeps failing, drain it (take it out of the job) before rerunning; "
    ), last
    assert [row["step"] for row in read_metrics(run) if "recovered_ranks" in row] == [2]  # the first was recovered


def test_a_rank_lost_while_sending_its_state_stops_the_run_in_one_line(runs) -> None:
    """dp2: both replicas of the state lost (the survivor as it was about to send it): the run stops
    with one line saying so and what a rerun does, no traceback; its checkpoint and rows are kept."""
    run, done = runs["sender lost"]
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert re.fullmatch(
        r"meshrun: error: rank [01]'s state was not copied: a rank was lost while it was copied \(the replica sending "
        r"it, or another\); rerun the same command to resume from the newest checkpoint \(from the start if none\)",
        lines[-1],
    ), lines[-1]
    assert "Traceback" not in done.stderr
    assert [row["step"] for row in read_metrics(run) if "loss" in row] == [1, 2]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert (run / "checkpoints" / "step-00000002" / ".metadata").is_file()


def test_report_says_each_recovery_and_marks_it_on_the_loss_curve(runs, tmp_path: Path) -> None:
    (hung, _), (repeated, _), (restarted, _) = runs["hung"], runs["repeated"], runs["restarted"]
    args = ["report", hung, repeated, restarted, "--out", tmp_path / "report.png"]
    done = meshrun_in_process(args, tmp_path=tmp_path)
    host = socket.gethostname()
    lines = done.stdout.split("recoveries (a worker lost, and how the run went on):\n")[1].split("\n\n")[0].splitlines()
    assert len(lines) == 4, done.stdout
    event = next(row for row in read_metrics(hung) if "recovered_ranks" in row)
    assert lines[0].startswith(f"  hung step 3: rank 1 on node {host} made no progress at step 3 (forward) for ")
    assert lines[0].endswith(
        f"recovered by a peer copy from rank 0's memory in {event['recovery_s']:.1f} s; steps lost: 0"
    )
    restart = next(row for row in read_metrics(restarted) if "resumed_from_step" in row)
    assert restart["steps_lost"] == 1  # step 4, logged after the checkpoint of step 3, trained again
    assert lines[3] == (
        f"  restarted step 5: a worker was lost; every worker restarted from the checkpoint of step 3 in "
        f"{restart['restart_s']:.1f} s (from the last logged step to the checkpoint loaded); steps lost: 1 (logged, trained again)"
    )
    event = next(row for row in read_metrics(repeated) if "recovered_ranks" in row)
    assert lines[1:3] == [
        (
            f"  repeated step 3: rank 1 on node {host} was killed by SIGKILL; recovered by a peer copy from rank 0's "
            f"memory in {event['recovery_s']:.1f} s; steps lost: 0"
        ),
        f"  repeated rank 1 on node {host} was killed by SIGKILL; not recovered: no replacement left (launch.max_restarts)",
    ]
    assert (tmp_path / "report.png").stat().st_size > 0
    from meshrun.metrics.plots import plt

    record = read_run(hung)
    _, ax = plt.subplots()
    mark_recoveries(ax, record, "C0")
    (marker,) = ax.get_lines()
    step3 = next(row for row in record.rows if row.get("step") == 3 and "loss" in row)
    assert marker.get_marker() == "X" and np.asarray(marker.get_xdata()).tolist() == [3 * record.tokens_per_step]
    assert np.asarray(marker.get_ydata()).tolist() == [step3["loss"]]
    plt.close("all")


def simulated_goodput(terms: Measured, every_s: float, *, peer: bool, failures: int = 3000) -> float:
    """The same run played out step by step: steps and a save every `interval` steps, a failure
    every `every_s` (jittered by up to a checkpoint period either way, so that failures land at every
    point of a period), each costing its recovery and the work since the last step (peer) or the
    last completed save (checkpoint): kept training seconds over wall seconds."""
    rng = random.Random(0)
    t, kept, pending, done = 0.0, 0.0, 0, 0  # pending: steps since the last save; done: in this period
    fail_at = every_s
    for _ in range(failures):
        while True:
            save = done == terms.interval
            length = terms.save_s if save else terms.step_s
            if t + length > fail_at:
                break
            t += length
            if save:
                kept, pending, done = kept + (0 if peer else pending * terms.step_s), 0, 0
            else:
                kept, pending, done = kept + (terms.step_s if peer else 0), pending + 1, done + 1
        t = fail_at + (terms.peer_s if peer else terms.restart_s)
        if not peer:
            pending, done = 0, 0  # back at the last checkpoint
        fail_at += every_s + rng.uniform(-1, 1) * terms.period_s()
    return kept / t


def test_goodput_from_the_measured_terms_equals_a_simulated_run(runs) -> None:
    """Its inputs are the runs' own: the restarted run's median step and save, each recovery from
    the logged step before it to the first step trained after it, less a step; the closed form
    agrees with a step-by-step simulation of a run failing every minute and every 10 minutes."""
    peer_rows, restart_rows = read_metrics(runs["repeated"][0]), read_metrics(runs["restarted"][0])
    terms = measured(peer_rows, restart_rows, interval=INTERVAL)
    steps = sorted(row["step_time_s"] for row in restart_rows if "loss" in row)
    times = {row["step"]: row["time"] for row in peer_rows if "loss" in row}
    event = next(row for row in restart_rows if "resumed_from_step" in row)
    first = next(row for row in restart_rows if row["step"] == 4 and row["time"] > event["time"])
    assert terms.step_s == pytest.approx((steps[len(steps) // 2 - 1] + steps[len(steps) // 2]) / 2)
    assert terms.save_s == statistics.median(
        r["checkpoint_s"] for r in restart_rows if "checkpoint_s" in r and "loss" not in r
    )
    assert terms.peer_s == pytest.approx(
        times[3] - times[2] - statistics.median(r["step_time_s"] for r in peer_rows if "loss" in r)
    )
    assert terms.restart_s == pytest.approx(event["restart_s"] + first["time"] - event["time"] - terms.step_s)
    assert terms.restart_s > 0 and terms.peer_s > 0  # which is smaller is the bench's to say (a loaded CPU here)
    for every_s, peer in itertools.product((60, 600), (True, False)):
        expected = simulated_goodput(terms, every_s, peer=peer)
        assert terms.goodput(every_s, peer=peer) == pytest.approx(expected, rel=1e-3), (every_s, peer)


def test_report_leaves_out_failure_records_meshrun_did_not_write(runs, tmp_path: Path) -> None:
    """A failures file or event row from elsewhere (wrong types, escapes, missing keys) is left out,
    not printed or a crash; the run's own lines stay."""
    run = tmp_path / "hung"
    shutil.copytree(runs["hung"][0], run)
    (run / "failures" / "rank0.json").write_text(
        json.dumps([{"rank": 0, "host": "h\x1b[2J", "how": "x", "at": 1.0, "job": "", "replaced": True}, 7, {"a": 1}])
    )
    (run / "failures" / "rank9.json").write_text("[[[")
    with (run / "metrics.jsonl").open("a") as rows:
        rows.write(json.dumps({"step": 4, "recovered_ranks": "0", "steps_lost": 0}) + "\n")
    done = meshrun_in_process(["report", run, "--out", tmp_path / "r.png"], tmp_path=tmp_path)
    lines = done.stdout.split("how the run went on):\n")[1].split("\n\n")[0].splitlines()
    assert len(lines) == 1 and lines[0].startswith("  hung step 3: rank 1 on node "), done.stdout
