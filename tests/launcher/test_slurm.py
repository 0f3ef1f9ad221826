"""Config -> sbatch script, and real Slurm jobs (slurmctld + two slurmd on localhost): a two-node
job completes; a job warned with USR1 checkpoints, requeues itself and finishes bit-identical to
an uninterrupted one; a worker killed under launch.recovery peer is replaced from its peer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, final_weights, meshrun_env, read_metrics, run_meshrun, tiny
from peer_runs import HERE, JOB, assert_recovered, train
from slurm_cluster import SlurmCluster, free_port, slurm_cluster_fixture, wait_until  # noqa: F401 (registers the slurm_cluster fixture)

from meshrun.config.schema import load_config
from meshrun.errors import ConfigError
from meshrun.launcher.slurm import BODY_MARKER, render_sbatch, template

# Enough steps (~0.1 s each) that USR1, sent once 3 are logged, lands mid-run despite Slurm's latency.
STEPS = 100
LAYOUT = {"parallel.dp": 1, "parallel.pp": 2, "train.steps": STEPS, "train.lr": 3e-3}  # a pipeline stage per node


# ---- rendering (pure) -------------------------------------------------------------------------


def header(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_render_splits_workers_over_nodes_and_keeps_site_settings_optional(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("parallel:\n  dp: 4\n  pp: 2\n")
    cfg = load_config(config, ["train.lr=3e-4", "launch.max_restarts=2"])
    script = render_sbatch(
        cfg, config=config, overrides=["train.lr=3e-4", "launch.max_restarts=2"], nodes=2, gpus_per_node=4
    )
    assert header(script) == [
        "--job-name=meshrun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        "--cpus-per-task=4",  # one per worker: Slurm's default of one CPU per task would share a core
        "--mem=0",  # all of each node's memory: a site's per-CPU default could kill the job
        "--signal=B:USR1@300",
        "--requeue",
        "--open-mode=append",
        "--output=slurm-%x-%j.out",
    ]
    assert f"MESHRUN_ARGS=({config.resolve()} --set=train.lr=3e-4 --set=launch.max_restarts=2)" in script
    assert "NPROC_PER_NODE=4\n" in script and "MAX_RESTARTS=2\n" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in script
    assert '--rdzv-endpoint="$HEAD:$PORT" --rdzv-id="$SLURM_JOB_ID"' in script  # c10d: meshrun.launcher.torchrun
    assert "torch.distributed.run" not in script  # the torchrun command line is built in one place
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    site = render_sbatch(
        cfg,
        config=None,
        overrides=[],
        nodes=8,
        gpus_per_node=1,
        partition="gpu",
        account="proj",
        time="4:00:00",
        cpus_per_task=16,
        signal_seconds=90,
        sbatch_options=["--qos=high"],
    )
    assert {
        "--partition=gpu",
        "--account=proj",
        "--time=4:00:00",
        "--cpus-per-task=16",
        "--signal=B:USR1@90",
        "--qos=high",
    } <= set(header(site))
    assert "MESHRUN_ARGS=()" in site  # no config: the packaged default
    for text in (script, site, template()):
        assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0


@pytest.mark.parametrize(
    "nodes,gpus,message",
    [
        (3, 0, "--nodes 3 must divide parallel.dp x parallel.pp"),
        (2, 2, "4 per node, but --gpus-per-node is 2"),
    ],
)
def test_render_refuses_layouts_that_do_not_fit(nodes: int, gpus: int, message: str) -> None:
    cfg = load_config(None, ["parallel.dp=4", "parallel.pp=2"])
    with pytest.raises(ConfigError, match=message):
        render_sbatch(cfg, config=None, overrides=[], nodes=nodes, gpus_per_node=gpus)


def test_launch_script_is_the_rendered_template() -> None:
    """launch/slurm.sbatch is the package's template, and `meshrun slurm` scripts end with its job part."""
    assert (REPO / "launch" / "slurm.sbatch").read_text() == template()
    script = render_sbatch(
        load_config(None, ["parallel.dp=1", "parallel.pp=2"]), config=None, overrides=[], nodes=2, gpus_per_node=1
    )
    job = template().split(BODY_MARKER, 1)[1]
    assert len(job.splitlines()) > 50 and script.endswith(job) and BODY_MARKER not in script


def test_cli_prints_the_script_and_exits_2_on_bad_layouts(tmp_path: Path) -> None:
    ok = run_meshrun(
        ["slurm", "--set=parallel.dp=1", "--set=parallel.pp=2", "--nodes=2", "--gpus-per-node=1", "--partition=p1"],
        tmp_path=tmp_path,
        timeout=60,
    )
    assert ok.stdout.startswith("#!/usr/bin/env bash") and "#SBATCH --partition=p1" in ok.stdout
    bad = run_meshrun(
        ["slurm", "--set=parallel.dp=1", "--set=parallel.pp=2", "--nodes=4", "--gpus-per-node=1"],
        tmp_path=tmp_path,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--nodes 4 must divide" in bad.stderr


# ---- real Slurm --------------------------------------------------------------------------------


def job_env(cluster: SlurmCluster, tmp_path: Path, **extra: str) -> dict[str, str]:
    """What the test submits with: sbatch passes it on to the job. Node names n1/n2 do not resolve
    here, so the rendezvous goes to 127.0.0.1 (on a real cluster: the first node's name)."""
    return meshrun_env(
        tmp_path,
        SLURM_CONF=str(cluster.conf),
        MESHRUN_RDZV_HOST="127.0.0.1",
        MESHRUN_RDZV_PORT=str(free_port()),
        MESHRUN_PYTHON=sys.executable,
        **extra,
    )


def slurm_args(data_dir: Path, run_dir: Path) -> list[str]:
    return ["slurm", *tiny(data_dir, run_dir, **LAYOUT), "--nodes=2", "--gpus-per-node=0", "--signal-seconds=60"]


def job_log(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("slurm-*.out")))


def loss_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir) if "loss" in row]


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster: SlurmCluster, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-node job submitted with `sbatch --wait` and left alone."""
    tmp = tmp_path_factory.mktemp("slurm-job")
    script = tmp / "job.sbatch"
    script.write_text(run_meshrun(slurm_args(data_dir, tmp / "run"), tmp_path=tmp, timeout=60).stdout)
    try:
        done = slurm_cluster.run(
            "sbatch",
            "--wait",
            "--parsable",
            str(script),
            env=job_env(slurm_cluster, tmp),
            cwd=tmp,
            timeout=300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"sbatch --wait timed out\n{job_log(tmp)}\n{slurm_cluster.log_tails()}")
    assert done.returncode == 0, f"job failed: {done.stderr}\n{job_log(tmp)}\n{slurm_cluster.log_tails()}"
    return tmp / "run"


@pytest.mark.timeout(120)
def test_cpus_per_task_defaults_to_the_partitions_node_cpus(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """One agent task per node holds all its workers: it asks for the node's CPUs as sinfo reports
    them (2 on this cluster's nodes), not one per worker (1 here), unless --cpus-per-task says so."""
    argv = ["slurm", "--set=parallel.dp=2", "--nodes=2", "--gpus-per-node=0"]
    env = meshrun_env(tmp_path, SLURM_CONF=str(slurm_cluster.conf))
    script = run_meshrun(argv, tmp_path=tmp_path, env=env, timeout=60).stdout
    assert "#SBATCH --cpus-per-task=2" in script.splitlines()
    explicit = run_meshrun([*argv, "--cpus-per-task=1"], tmp_path=tmp_path, env=env, timeout=60).stdout
    assert "#SBATCH --cpus-per-task=1" in explicit.splitlines()


@pytest.mark.timeout(420)
def test_two_node_job_completes(uninterrupted: Path, slurm_cluster: SlurmCluster) -> None:
    assert loss_steps(uninterrupted) == list(range(1, STEPS + 1))
    log = job_log(uninterrupted.parent)
    assert "on n[1-2], 2 nodes x 1 workers" in log, log
    assert (uninterrupted / "summary.json").exists()


@pytest.mark.timeout(600)
def test_usr1_checkpoints_requeues_and_resumes_bit_identical(
    uninterrupted: Path, slurm_cluster: SlurmCluster, data_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    env = job_env(slurm_cluster, tmp_path)
    submitted = run_meshrun([*slurm_args(data_dir, run_dir), "--submit"], tmp_path=tmp_path, env=env, timeout=60)
    job = submitted.stdout.strip()
    assert job.isdigit(), submitted.stdout
    try:
        # signal mid-run: after a few steps are logged, well before the last
        wait_until(
            lambda: (run_dir / "metrics.jsonl").exists() and len(loss_steps(run_dir)) >= 3,
            timeout=180,
            what="the first steps",
            cluster=slurm_cluster,
        )
        slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)

        def finished() -> bool:
            return slurm_cluster.job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")

        wait_until(finished, timeout=360, what=f"job {job} to finish after requeue", cluster=slurm_cluster)
    finally:
        slurm_cluster.run("scancel", job, check=False)
    log = job_log(tmp_path)
    assert slurm_cluster.job_field(job, "JobState") == "COMPLETED", f"{log}\n{slurm_cluster.log_tails()}"
    assert int(slurm_cluster.job_field(job, "Restarts")) == 1, log
    assert "USR1 received" in log and "requeueing job" in log and "(restart 1)" in log, log
    assert "stop requested: checkpoint at step" in log and "resumed from" in log, log  # no restart from scratch
    steps = loss_steps(run_dir)
    assert steps == list(range(1, STEPS + 1)), f"steps logged twice or missing: {steps}"
    ours, reference = final_weights(run_dir), final_weights(uninterrupted)
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours), "resumed run differs from the uninterrupted one"


@pytest.mark.timeout(700)
def test_a_killed_rank_under_slurm_is_replaced_from_its_peer(
    slurm_cluster: SlurmCluster, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch.recovery peer under `meshrun slurm` (issue 46): dp2, a worker on each of two nodes, rank
    1 SIGKILLed mid-step; its node's keeper replaces it, and the job ends with the weights of the same
    job run uninterrupted on one node, each step once, no checkpoint read."""
    plain, _ = train(data_dir, tmp_path / "uninterrupted", JOB)
    factory = meshrun_env(tmp_path, PYTHONPATH=HERE)  # finds the model.factory
    run = tmp_path / "killed"
    settings = {**JOB, "launch.recovery": "peer", "launch.warm_spare": True}
    argv = ["slurm", *tiny(data_dir, run, **settings), "--nodes=2", "--gpus-per-node=0"]
    script = tmp_path / "job.sbatch"
    script.write_text(run_meshrun(argv, tmp_path=tmp_path, env=factory, timeout=60).stdout)
    env = job_env(slurm_cluster, tmp_path, PYTHONPATH=HERE, MESHRUN_TEST_KILL_AT="5", MESHRUN_TEST_ON_RANK="1")
    done = slurm_cluster.run("sbatch", "--wait", str(script), env=env, cwd=tmp_path, timeout=400, check=False)
    log = job_log(tmp_path)
    assert done.returncode == 0, f"job failed: {done.stderr}\n{log}\n{slurm_cluster.log_tails()}"
    assert "rank 1 was killed by SIGKILL" in log, log
    runs = {"uninterrupted": (plain, None), "killed": (run, subprocess.CompletedProcess([], 0, "", log))}
    assert_recovered(runs, monkeypatch, events=[(2, "1", 0, 0)])
