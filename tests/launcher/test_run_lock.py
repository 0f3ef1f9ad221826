"""One job per run directory, across nodes and launch modes: the lock (meshrun.launcher.run_lock)
in-process, then real jobs: two 2-node jobs over loopback agents, a lock record deleted under a
running job, and workers of a torchrun started by hand."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import descendants, finish_meshrun, kill_tree, meshrun_env, read_metrics, start_meshrun, tiny, wait_for
from test_torchrun import free_port

from meshrun.errors import ConfigError
from meshrun.launcher import run_lock
from meshrun.launcher.run_lock import FALLBACK_LOCK, LOCK, hold_run_dir, pid_space, read_owner

STEPS = 6


def test_one_job_holds_a_run_dir_its_own_processes_share_it(tmp_path: Path) -> None:
    with hold_run_dir(tmp_path, job="a at h:1", role="meshrun train") as held:
        assert held.fd is not None and read_owner(tmp_path) == held.owner
        with hold_run_dir(tmp_path, job="a at h:1", role="meshrun train") as sibling:  # another node of job a
            assert sibling.fd is None
        with pytest.raises(ConfigError) as refused, hold_run_dir(tmp_path, job="b at h:2", role="meshrun train"):
            pass
        said = str(refused.value)
        assert f"is in use by another meshrun job (pid {os.getpid()} (meshrun train) on " in said
        assert "job a at h:1" in said
        (tmp_path / LOCK).unlink()  # the record deleted: the lock, on the folder itself, still holds
        missing = pytest.raises(ConfigError, match=f"its owner record {LOCK} is missing")
        with missing, hold_run_dir(tmp_path, job="b at h:2", role="meshrun train"):
            pass
    with hold_run_dir(tmp_path, job="b at h:2", role="meshrun train") as later:  # free once its holder ended
        assert later.fd is not None


def test_a_record_of_holders_all_gone_does_not_make_a_sibling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crashed run's record names this job, but another job holds the lock (its record not yet
    written): not taken for this job's owner; refused once the wait for a record is over. A record
    from another pid space (a container on this host) is believed."""
    monkeypatch.setattr(run_lock, "RECORD_WAIT_S", 0.3)
    with hold_run_dir(tmp_path, job="b", role="meshrun train"):
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        )
        record = {"job": "a", "host": "here", "pids": pid_space(), "holders": [[int(dead.stdout), "meshrun train"]]}
        (tmp_path / LOCK).write_text(json.dumps(record))
        with pytest.raises(ConfigError, match="no living holder named"), hold_run_dir(tmp_path, job="a", role="x"):
            pass
        record["pids"] = "another container's"  # its holders cannot be asked from here: taken as alive
        (tmp_path / LOCK).write_text(json.dumps(record))
        with hold_run_dir(tmp_path, job="a", role="meshrun train") as sibling:
            assert sibling.fd is None


def test_a_filesystem_that_cannot_lock_a_folder_locks_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NFS locks only files open for writing (flock on a folder: EBADF)."""
    real = fcntl.flock

    def nfs_flock(fd: int, op: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EBADF, "Bad file descriptor")
        real(fd, op)

    monkeypatch.setattr(run_lock.fcntl, "flock", nfs_flock)
    with hold_run_dir(tmp_path, job="a", role="meshrun train"):
        assert (tmp_path / FALLBACK_LOCK).is_file()
        with (
            pytest.raises(ConfigError, match="in use by another meshrun job"),
            hold_run_dir(tmp_path, job="b", role="x"),
        ):
            pass


def test_a_config_json_written_after_the_checks_is_checked_once_the_lock_is_held(
    data_dir: Path, tmp_path: Path
) -> None:
    """Job B was checked while run_dir was empty; job A (another learning rate) then trained there and
    ended, leaving its config.json: B, taking the now free lock, must not run over it."""
    from meshrun.cli import train as job
    from meshrun.config.schema import load_config

    run = tmp_path / "run"
    a, b = (
        load_config(None, [s.removeprefix("--set=") for s in tiny(data_dir, run, **{"train.lr": lr})])
        for lr in (1e-3, 5e-3)
    )
    run.mkdir()
    (run / "config.json").write_text(json.dumps(a.model_dump(mode="json")))  # written after B's preflight
    with pytest.raises(ConfigError, match=re.escape("other settings (train.lr is 0.001 there, 0.005 here)")):
        job.train(b, [], model=None)  # type: ignore[arg-type]  (refused before the model is used)
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def two_node_job(data_dir: Path, run: Path, lr: float) -> list[str]:
    """`meshrun train` arguments of one 2-node job (dp1 x pp2, a worker per node) on its own rendezvous."""
    layout = {"parallel.dp": 1, "parallel.pp": 2, "train.steps": STEPS, "train.lr": lr}
    rendezvous = [f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={uuid.uuid4().hex[:8]}"]
    return ["train", *tiny(data_dir, run, **layout), "--nnodes=2", *rendezvous, "--rdzv-timeout=300"]


def assert_refused(proc: subprocess.Popen, *said: str) -> None:
    refused = finish_meshrun(proc, timeout=180, check=False)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
    assert "is in use by another meshrun job" in refused.stderr and all(s in refused.stderr for s in said)


def workers_of(launchers: list[int]) -> list[int]:
    """The workers below these launchers (their agents' children)."""
    agents = {pid for launcher in launchers for pid in descendants(launcher) if _parent(pid) == launcher}
    return [pid for agent in agents for pid in descendants(agent)]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(500)
def test_a_second_multi_node_job_is_refused_while_the_first_holds_the_run_dir(data_dir: Path, tmp_path: Path) -> None:
    """Two 2-node jobs with different learning rates into one run_dir both trained (multi-node launches
    took no lock), and the first job's rows and checkpoints were gone. Now the second is refused in one
    line naming the first's living holders; with its lock record deleted too; the first trains on."""
    run = tmp_path / "run"
    first, second = two_node_job(data_dir, run, 1e-3), two_node_job(data_dir, run, 5e-3)
    host = start_meshrun(first, tmp_path=tmp_path)  # its other node comes later: it holds the run_dir while it waits
    procs = [host]
    try:
        wait_for(lambda: len(getattr(read_owner(run), "holders", [])) == 2, timeout=180, what="the first job's agent")
        owner = read_owner(run)
        assert owner is not None
        (_, _), (agent, _) = owner.holders
        both = [start_meshrun(second, tmp_path=tmp_path) for _ in range(2)]  # the second job's two nodes
        for node in both:
            assert_refused(node, f"(pid {host.pid} (meshrun train), pid {agent} (its torchrun agent) on ")
        procs.append(start_meshrun(first, tmp_path=tmp_path))  # the first job's other node: its own job's lock
        wait_for(lambda: (run / "metrics.jsonl").is_file(), timeout=180, what="the first job to train")
        frozen = workers_of([proc.pid for proc in procs])
        for pid in frozen:  # hold the first job still mid-run while the second tries again
            os.kill(pid, signal.SIGSTOP)
        (run / LOCK).unlink()
        same = two_node_job(data_dir, run, 1e-3)  # the first job's config: nothing but the lock refuses it
        assert_refused(start_meshrun(same, tmp_path=tmp_path), f"its owner record {LOCK} is missing")
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        for proc in procs:
            finish_meshrun(proc, timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
    assert [row["step"] for row in read_metrics(run) if "loss" in row] == list(range(1, STEPS + 1))
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 1e-3
    assert (run / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").is_file()


@pytest.mark.timeout(300)
def test_workers_of_a_torchrun_started_by_hand_take_the_lock(data_dir: Path, tmp_path: Path) -> None:
    """`torchrun ... -m meshrun train` without meshrun's launcher: its workers hold the run_dir
    for their job (both ranks share it), and are refused where another job holds it."""
    run = tmp_path / "run"
    torchrun = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    argv = [*torchrun, "-m", "meshrun", "train", *tiny(data_dir, run, **{"parallel.dp": 2, "train.steps": 2})]

    def by_hand() -> subprocess.CompletedProcess:
        env = meshrun_env(tmp_path)
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)

    with hold_run_dir(run, job="another", role="meshrun train"):
        refused = by_hand()
    assert refused.returncode != 0 and not (run / "config.json").exists(), refused.stderr[-3000:]
    said = f"meshrun: error: run_dir {run} is in use by another meshrun job (pid {os.getpid()} (meshrun train) on "
    # each worker checks for itself; torchrun's agent may end the second once the first has exited
    assert refused.stderr.count(said) in (1, 2), refused.stderr[-3000:]
    done = by_hand()
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["step"] for row in read_metrics(run) if "loss" in row] == [1, 2]
    assert not (run / LOCK).exists()  # the holding worker removed its record as it ended
