"""launch.recovery peer through `meshrun train` (issue 46): a dp2 DDP job whose rank 0 (the one that
records the run) is SIGKILLed mid-step finishes with the weights of an uninterrupted run, each step
trained once, no checkpoint read, the recovery recorded and said in two lines (the keeper's, and
the replacement's as rank 0); so does the default job's layout, dp2 x pp2, whose rank 1 is killed
(the other stage's ranks regroup and train the step again too), and HSDP dp4 (2 replicas x 2 shards),
whose replacement takes its shard from the other replica. Real torchrun, keepers, a warm spare,
gloo; the layouts peer recovery is not built for are refused before any worker starts. dp1 x pp2
and fsdp under peer are the checkpoint launch (test_peer_recovery_runs_each_worker_under_a_keeper...),
whose restart is bit-identical (tests/training/test_preemption.py::test_killed_rank_restarts_and_resumes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    in_process_trainer,
    losses,
    meshrun_env,
    meshrun_in_process,
    read_metrics,
    tiny,
)
from nodes import free_port, run_nodes
from peer_runs import HERE, JOB, assert_recovered, train

from meshrun.config.schema import load_config
from meshrun.config.topology import no_replica
from meshrun.errors import ConfigError
from meshrun.launcher.failures import read_losses
from meshrun.launcher.k8s import PodOptions, check_options
from meshrun.launcher.torchrun import KEEPER, torchrun_argv, worker_env
from meshrun.training.recovery import share_state


def launch(
    data_dir: Path, tmp: Path, job: dict[str, object], kill: dict[str, str]
) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """`job` uninterrupted, and under launch.recovery peer with a warm spare and `kill` (on cue)."""
    return {"uninterrupted": train(data_dir, tmp / "uninterrupted", job), "killed": killed(data_dir, tmp, job, kill)}


def killed(
    data_dir: Path, tmp: Path, job: dict[str, object], kill: dict[str, str]
) -> tuple[Path, subprocess.CompletedProcess]:
    """`job` under launch.recovery peer with a warm spare and `kill` (on cue)."""
    return train(data_dir, tmp / "killed", {**job, "launch.recovery": "peer", "launch.warm_spare": True}, kill)


@pytest.fixture(scope="module")
def runs(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    return launch(
        data_dir, tmp_path_factory.mktemp("recovery"), JOB, {"MESHRUN_TEST_KILL_AT": "5", "MESHRUN_TEST_ON_RANK": "0"}
    )


@pytest.mark.timeout(700)  # the fixture's two launches, on loaded cores
def test_a_killed_rank_is_replaced_from_its_peer_and_no_step_is_lost(runs, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_recovered(runs, monkeypatch, events=[(2, "0", 1, 0)])


@pytest.mark.timeout(400)
def test_ranks_lost_between_steps_in_the_commit_and_while_recovering_are_replaced_and_no_step_is_lost(
    runs, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 (the recorder) killed as it enters step 2's log row (its peer waits in the row's
    gather): its replacement takes the state after step 2 and the window's losses (gathered by every
    commit) and writes step 2's row; that one killed as it enters step 3's evaluation, and the next as
    it enters the run's last checkpoint (after the last step: its replacement saves it and writes the
    summary). Rank 1 killed as step 4's commit returns, before its optimizer steps: its peer either
    fails in the commit (not stepped: step 4 trained again) or steps and fails after it (the state
    after step 4); and rank 1's replacement killed as it takes its state: rank 0 recovers again with
    the next one. Each step once, the uninterrupted run's weights."""
    kill = {
        "MESHRUN_TEST_KILL_IN": "0:log:2,0:eval:3,0:checkpoint:6",
        "MESHRUN_TEST_KILL_AFTER_COMMIT": "1:4",
        "MESHRUN_TEST_KILL_RECEIVING": "1",
        "MESHRUN_TEST_ONCE_DIR": str(tmp_path),
    }
    job = {**JOB, "launch.max_restarts": 3, "train.eval_interval": 3}
    run = killed(data_dir, tmp_path, job, kill)
    events = assert_recovered({**runs, "killed": run}, monkeypatch)
    assert events[:2] == [(2, "0", 1, 0), (3, "0", 1, 0)] and events[3] == (6, "0", 1, 0), events
    assert events[2] in ((3, "1", 0, 0), (4, "1", 0, 0)), events  # one recovery for rank 1's two losses
    assert [loss.rank for loss in read_losses(run[0])] == [0, 0, 1, 1, 0]
    said = [line for line in run[1].stderr.splitlines() if line.startswith("[meshrun] recovered")]
    assert [line.split(" in ")[0] for line in said[:2] + said[3:]] == [
        "[meshrun] recovered after step 2 (in the log row's gathers)",
        "[meshrun] recovered after step 3 (in an evaluation)",
        "[meshrun] recovered after step 6 (in a checkpoint save)",
    ], said
    assert said[2].startswith(
        "[meshrun] recovered at step 4" if events[2][0] == 3 else "[meshrun] recovered after step 4"
    )
    rows = read_metrics(run[0])
    assert [row["step"] for row in rows if "val_loss" in row] == [3, 6]
    assert json.loads((run[0] / "summary.json").read_text())["final_loss"] == losses(run[0])[-1]


@pytest.mark.timeout(900)  # two launches of 4 ranks (keepers and spares beside), on loaded cores
def test_a_killed_pipeline_rank_is_replaced_from_its_stage_replica(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dp2 x pp2 (1F1B): rank 1 (stage 0) killed in step 3's second forward; ranks 2 and 3 (stage 1),
    which hold none of its state, regroup and train the step again with ranks 0 and 1."""
    job = {**JOB, "parallel.pp": 2}
    runs = launch(data_dir, tmp_path, job, {"MESHRUN_TEST_KILL_AT": "7", "MESHRUN_TEST_ON_RANK": "1"})
    assert_recovered(runs, monkeypatch, events=[(2, "1", 0, 0)])
    plain, killed = (runs[name][1].stderr.splitlines() for name in ("uninterrupted", "killed"))
    assert len([line for line in killed if "straggler" not in line]) <= len(plain) + 2, killed


@pytest.mark.timeout(700)  # two agents, keepers and a spare each, on loaded cores
def test_a_killed_rank_on_another_node_is_replaced_from_its_peer(
    runs, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dp2 over two nodes (two torchrun agents, c10d rendezvous over loopback, a worker each): rank 1,
    on the second node, killed mid-step; its node's keeper replaces it, the workers regroup over the
    host agent's store, and the run equals the one-node uninterrupted run."""
    endpoint = f"127.0.0.1:{free_port()}"
    settings = {**JOB, "launch.recovery": "peer", "launch.warm_spare": True}
    args = ["train", *tiny(data_dir, tmp_path / "run", **settings), "--nnodes=2", f"--rdzv-endpoint={endpoint}"]
    env = meshrun_env(tmp_path, PYTHONPATH=HERE, MESHRUN_TEST_KILL_AT="5", MESHRUN_TEST_ON_RANK="1")
    node = ([sys.executable, "-m", "meshrun", *args, "--rdzv-id=peer"], env)
    said = run_nodes([node, node], cwd=tmp_path, timeout=300)
    two_nodes = {**runs, "killed": (tmp_path / "run", subprocess.CompletedProcess([], 0, "", "\n".join(said)))}
    assert_recovered(two_nodes, monkeypatch, events=[(2, "1", 0, 0)])
    assert sum("rank 1 was killed by SIGKILL" in out for out in said) == 1, said


@pytest.mark.timeout(900)  # two launches of 4 ranks (keepers and spares beside), on loaded cores
def test_a_killed_hsdp_rank_takes_its_shard_from_the_other_replica(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HSDP dp4, 2 replicas x 2 shards (rank = replica x 2 + shard): rank 1 (replica 0, shard 1)
    killed in step 3's first forward; every survivor builds its FSDP2 state again over the new
    meshes with its own shards, and the replacement takes shard 1 from rank 3, the other replica's."""
    job = {**JOB, "parallel.dp": 4, "parallel.dp_mode": "hsdp", "parallel.dp_shard": 2, "train.global_batch": 16}
    runs = launch(data_dir, tmp_path, job, {"MESHRUN_TEST_KILL_AT": "5", "MESHRUN_TEST_ON_RANK": "1"})
    assert_recovered(runs, monkeypatch, events=[(2, "1", 3, 0)])
    assert "rank 1's state copied from rank 3's memory; no step lost" in runs["killed"][1].stderr


def test_a_recovered_failure_is_two_lines(runs) -> None:
    """The keeper's line (which rank, how it died) and rank 0's (from whom, how long, steps lost);
    nothing else beyond an uninterrupted run's lines."""
    plain, killed = (runs[name][1].stderr.splitlines() for name in ("uninterrupted", "killed"))
    added = [line for line in killed if "rank 0" in line and "straggler" not in line]  # its first steps: slow
    assert len(added) == 2, killed
    assert added[0] == (
        "[meshrun] rank 0 was killed by SIGKILL; its spare takes over (1 of 1), which takes its state from a replica"
    )
    assert re.fullmatch(
        r"\[meshrun\] recovered at step 3 in [\d.]+ s \([\d.]+ s until the replacement joined, [\d.]+ s building "
        r"its model and copying the state\): rank 0's state copied from rank 1's memory; no step lost",
        added[1],
    ), added[1]
    assert len([line for line in killed if "straggler" not in line]) <= len(plain) + 2, killed


def test_a_state_copied_before_the_first_step_counts_no_step(data_dir: Path, tmp_path: Path) -> None:
    """A peer lost in step 1: the state a survivor sends (torch's state-dict helper makes AdamW's
    state by a step at lr 0) leaves every optimizer as a fresh one, its step counts 0 and moments 0,
    so that the step trained again is AdamW's first, as in an uninterrupted run."""
    with in_process_trainer(data_dir, tmp_path / "run") as trainer:
        share_state(trainer.state, trainer.mesh, 0, holds=True)
        states = [state for optimizer in trainer.optimizers.optimizers for state in optimizer.state.values()]
        assert states and all(not tensor.any() for state in states for tensor in state.values())


def test_peer_recovery_runs_each_worker_under_a_keeper_on_the_agents_store() -> None:
    """dp2: the agent restarts nothing and shares its store; dp1: checkpoint restarts, as without peer."""
    peer = load_config(None, ["parallel.dp=2", "parallel.pp=1", "launch.recovery=peer", "launch.max_restarts=2"])
    argv = torchrun_argv(peer, ["train"])
    assert argv[argv.index("--max-restarts=0") + 1 :] == [
        *["-m", KEEPER, "--replacements=2", "--", sys.executable, "-P", "-m", "meshrun", "train"]
    ]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in worker_env(peer)
    alone = load_config(None, ["parallel.dp=1", "parallel.pp=2", "launch.recovery=peer", "launch.max_restarts=2"])
    assert KEEPER not in torchrun_argv(alone, ["train"]) and "--max-restarts=2" in torchrun_argv(alone, ["train"])
    assert worker_env(alone)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    fsdp = load_config(None, ["parallel.dp_mode=fsdp", "launch.recovery=peer", "launch.max_restarts=2"])  # dp 2
    assert KEEPER not in torchrun_argv(fsdp, ["train"]) and "--max-restarts=2" in torchrun_argv(fsdp, ["train"])
    said = "parallel.dp_mode fsdp shards each rank's state over all 2 dp ranks, none holds another's"
    assert no_replica(fsdp.parallel) == said  # launch's line: "launch.recovery peer: {said}, so no replica ..."


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        (
            ["parallel.pp=2", "parallel.schedule=gpipe"],
            (
                "launch.recovery peer is built for ddp data parallel with pipelines of schedule 1f1b split evenly or "
                "by parallel.stage_layers, and hsdp without pipelines, so far (parallel.schedule is gpipe); "
                "use launch.recovery checkpoint"
            ),
        ),
        (["parallel.pp=2", "parallel.balance=size"], "(parallel.balance is size)"),
        (
            ["parallel.dp=4", "parallel.pp=2", "parallel.dp_mode=hsdp", "parallel.dp_shard=2"],
            "and hsdp without pipelines, so far (parallel.dp_mode is hsdp with parallel.pp 2)",
        ),
        (["launch.max_restarts=0"], "at most launch.max_restarts times per rank (it is 0)"),
        (["precision=fp16"], "launch.recovery peer does not run fp16 so far"),
        (["launch.recovery=checkpoint", "launch.warm_spare=true"], "launch.warm_spare is for launch.recovery peer"),
    ],
)
def test_peer_recovery_where_it_is_not_built_is_refused_in_one_line(
    settings: list[str], said: str, data_dir: Path, tmp_path: Path
) -> None:
    base = ["parallel.dp=2", "launch.recovery=peer", "launch.max_restarts=1"]
    args: list[str | Path] = ["train", *tiny(data_dir, tmp_path / "run"), *(f"--set={s}" for s in [*base, *settings])]
    done = meshrun_in_process(args, tmp_path=tmp_path, check=False)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_k8s_refuses_peer_recovery_in_one_line() -> None:
    """A restarted pod does not join a running group as a replacement yet: refused, not run as a
    checkpoint job that says peer."""
    cfg = load_config(None, ["parallel.pp=1", "launch.recovery=peer", "launch.max_restarts=1"])
    with pytest.raises(
        ConfigError, match=r"launch.recovery peer runs under `meshrun train` and `meshrun slurm` so far"
    ):
        check_options(cfg, PodOptions(image="meshrun:1", nodes=1))
