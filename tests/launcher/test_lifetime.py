"""No job outlives its launcher's lock: killed outright (SIGKILL, a closed terminal), the
launcher's torchrun agent still holds the run_dir, stops its workers (they checkpoint) and ends;
an agent killed outright takes its workers with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import descendants, kill_tree, run_meshrun, start_meshrun, tiny, wait_for

from meshrun.launcher.lifetime import WORKER_NAME
from meshrun.launcher.run_lock import hold_run_dir

# Two workers under torchrun, far more steps than the test lasts, a row per step.
LONG = {"parallel.dp": 2, "train.steps": 1_000_000, "checkpoint.interval": 0, "train.log_interval": 1}


def living(pids: list[int]) -> list[int]:
    """Those of `pids` still running (an exited process waiting to be reaped is not)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
    return alive


def described(pids: list[int]) -> str:
    """Each pid's state and command line, for a failure message."""
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid} [{state}] {cmdline[:300]}")
    return "\n".join(lines)


def wait_until_ended(job: list[int], *, timeout: float, what: str) -> None:
    """Wait for every process of `job` to end; a failure names those still running."""
    try:
        wait_for(lambda: not living(job), timeout=timeout, what=what)
    except pytest.fail.Exception:
        pytest.fail(f"timed out waiting for {what}; still running:\n{described(living(job))}")


def trained_a_step(run: Path) -> bool:
    """A metrics row exists: every worker is past its setup and takes stop requests."""
    return (run / "metrics.jsonl").exists() and bool((run / "metrics.jsonl").read_text().strip())


def agent_of(pids: list[int]) -> int:
    return next(pid for pid in pids if b"meshrun.launcher.agent" in Path(f"/proc/{pid}/cmdline").read_bytes())


class Drained:
    """Both pipes of a started job read as they fill: its workers inherit them, and a worker
    writing a row per step into a full pipe nobody reads blocks in write() for good (no stop
    request can reach it there), which is the test's doing, not the job's."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = {"stdout": "", "stderr": ""}
        self.readers = [threading.Thread(target=self._read, args=(proc, name), daemon=True) for name in self.text]
        for reader in self.readers:
            reader.start()

    def _read(self, proc: subprocess.Popen, name: str) -> None:
        for line in getattr(proc, name):
            self.text[name] += line

    def stderr(self, timeout: float) -> str:
        """Everything the job wrote to stderr, once every writer has ended (or `timeout` passed)."""
        for reader in self.readers:
            reader.join(timeout)
        return self.text["stderr"]


@contextlib.contextmanager
def running_job(data_dir: Path, run: Path) -> Iterator[tuple[subprocess.Popen, list[int], Drained]]:
    """A two-worker job past its first step: its launcher, every process under it and its output.
    After the block, whatever of them is left is SIGKILLed: the processes recorded here too, as
    those that outlived their parent are nobody's descendants any more."""
    proc = start_meshrun(["train", *tiny(data_dir, run, **LONG)], tmp_path=run.parent)
    output = Drained(proc)
    job: list[int] = []
    try:
        wait_for(lambda: trained_a_step(run), timeout=180, what="the first step")
        job += descendants(proc.pid)
        yield proc, job, output
    finally:
        for pid in job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_tree(proc.pid)


@pytest.mark.timeout(600)
def test_a_killed_launchers_job_keeps_the_run_dir_until_every_process_has_ended(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    with running_job(data_dir, run) as (proc, job, output):
        agent = agent_of(job)
        os.kill(agent, signal.SIGSTOP)  # hold the job still while the test looks: it must keep the run_dir
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        second = run_meshrun(["train", *tiny(data_dir, run, **LONG)], tmp_path=tmp_path, timeout=120, check=False)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr[-3000:]
        assert "is in use by another meshrun job" in second.stderr
        assert f"(pid {agent} (its torchrun agent) on " in second.stderr  # the living holder, not its dead launcher
        assert f"pid {proc.pid} " not in second.stderr
        os.kill(agent, signal.SIGCONT)  # the SIGTERM its launcher's death queued: the workers checkpoint and stop
        wait_until_ended(job, timeout=120, what="every process of the first job to end")
    stderr = output.stderr(timeout=60)  # every writer has ended
    assert "stop requested: checkpoint at step" in stderr, stderr[-3000:]
    with hold_run_dir(run, job="next", role="test"):  # free once the last of them ended
        pass


@pytest.mark.timeout(600)
def test_workers_end_with_their_agent(data_dir: Path, tmp_path: Path) -> None:
    """The workers are forked from the agent's preloaded server (meshrun.launcher.forked), which
    ends with the agent as they do. The launcher then says in one line what killed the agent, exit
    128 + the signal (it exited 247, Python's -9 as a byte, and said nothing)."""
    with running_job(data_dir, tmp_path / "run") as (proc, job, output):
        named = [pid for pid in job if Path(f"/proc/{pid}/comm").read_text().startswith(WORKER_NAME)]
        servers = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in named}
        assert len(named) == 2 and len(servers) == 1, described(job)
        assert b"meshrun.launcher.fork_server" in Path(f"/proc/{servers.pop()}/cmdline").read_bytes()
        os.kill(agent_of(job), signal.SIGKILL)
        wait_until_ended(job, timeout=120, what="the workers to end")
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    said = output.stderr(timeout=60).splitlines()
    assert said[-1] == (
        "meshrun: error: torchrun's agent was killed by SIGKILL and its workers ended with it; "
        "no checkpoint is complete yet: rerunning the same command starts afresh"
    ), said[-5:]


# A worker's CLI ending: `meshrun train` of a missing config (exit 2), with a finalizer that speaks.
ENDING = """
import atexit, sys
atexit.register(lambda: print("finalized"))
print("said", end="")
sys.argv = ["meshrun", "train", "/nonexistent/meshrun.yaml"]
from meshrun.cli import run
run()
"""


@pytest.mark.parametrize("launched", [False, True])
def test_a_worker_ends_without_interpreter_finalization(launched: bool) -> None:
    """A launched worker ends as a forked one does (launcher/lifetime.end_worker): its console
    flushed, its status kept, no finalization (where gloo can abort a finished worker); the
    launcher's own process still finalizes."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if launched:
        env |= {"RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", ENDING], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "cannot read config file" in done.stderr
    assert done.stdout == ("said" if launched else "saidfinalized\n")
