"""A real Slurm cluster on localhost for tests: munged, slurmctld and two slurmd (nodes n1, n2).

Debian's slurm-wlm is installed when missing (CI runs as root on a fresh Debian machine); when
that is impossible the fixture fails, it does not skip. Every daemon gets its own free port and
temp folder (munged its own socket), so nothing on the machine is reused or disturbed, and all of
it is stopped at the end of the session, also after failures.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ["slurm-wlm", "slurmctld", "slurmd", "slurm-client", "munge"]
COMMANDS = ["slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged"]
NODES = ("n1", "n2")


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    logs: list[Path]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(
            argv, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=timeout, check=False, **kw
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def job_field(self, job_id: str, field: str) -> str:
        """One `scontrol show job` field (e.g. JobState, Restarts, ExitCode)."""
        out = self.run("scontrol", "show", "job", job_id, "--oneliner").stdout
        for item in out.split():
            key, _, value = item.partition("=")
            if key == field:
                return value
        raise AssertionError(f"no {field} in: {out}")

    def log_tails(self) -> str:
        return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-2000:]}" for log in self.logs if log.exists())


def ensure_installed() -> None:
    if all(shutil.which(c) for c in COMMANDS):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail(f"Slurm tests need {', '.join(PACKAGES)}; install them (apt-get as root) - refusing to skip")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_conf(root: Path, munge_socket: Path) -> Path:
    ctld_port, *node_ports = (free_port() for _ in range(1 + len(NODES)))
    lines = [
        "ClusterName=meshruntest",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire is also how long a requeued job waits before it may start (default 120 s)
        f"AuthInfo=socket={munge_socket},cred_expire=10",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "ReturnToService=2",
        "MinJobAge=300",  # keep finished jobs visible to `scontrol show job`
        "KillWait=30",
        *(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=2000"
            for n, p in zip(NODES, node_ports)
        ),
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
    ]
    for sub in ("state", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def wait_until(check, *, timeout: float, what: str, cluster: SlurmCluster | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{cluster.log_tails() if cluster else ''}")


@pytest.fixture(scope="session", name="slurm_cluster")  # named apart so a test's parameter does not shadow the import
def slurm_cluster_fixture(tmp_path_factory: pytest.TempPathFactory):
    ensure_installed()
    root = tmp_path_factory.mktemp("slurm")
    # munged refuses sockets in folders others can reach into unsafely, and runs as `munge`:
    # a folder of its own outside pytest's root-only temp folder.
    munge_dir = Path(tempfile.mkdtemp(prefix="meshrun-munge-"))
    munge_dir.chmod(0o755)
    shutil.chown(munge_dir, "munge", "munge")
    munge_socket = munge_dir / "munge.socket"
    conf = write_conf(root, munge_socket)
    logs = [root / "slurmctld.log", *(root / f"slurmd.{n}.log" for n in NODES), munge_dir / "munged.log"]
    cluster = SlurmCluster(conf=conf, logs=logs)
    procs: list[subprocess.Popen] = []

    def start(argv: list[str]) -> None:
        procs.append(
            subprocess.Popen(
                argv, env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
        )

    try:
        start(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                "--foreground",
                f"--socket={munge_socket}",
                f"--pid-file={munge_dir}/munged.pid",
                f"--log-file={munge_dir}/munged.log",
                f"--seed-file={munge_dir}/munged.seed",
            ]
        )
        wait_until(munge_socket.exists, timeout=30, what="munged", cluster=cluster)
        start(["slurmctld", "-D", "-i"])
        for node in NODES:
            start(["slurmd", "-D", "-N", node])

        def idle() -> bool:
            return set(cluster.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).stdout.split()) >= set(
                NODES
            )

        wait_until(idle, timeout=60, what=f"nodes {NODES} idle", cluster=cluster)
        yield cluster
    finally:
        cluster.run("scancel", "--user=root", check=False, timeout=30)
        cluster.run("scontrol", "shutdown", check=False, timeout=30)
        for proc in reversed(procs[1:]):  # slurm daemons: `scontrol shutdown` stops them
            stop(proc, grace=20)
        pid_file = munge_dir / "munged.pid"
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        if procs:
            stop(procs[0], grace=10)
        shutil.rmtree(munge_dir, ignore_errors=True)


def stop(proc: subprocess.Popen, *, grace: float) -> None:
    """Wait for a daemon to exit, then SIGTERM, then SIGKILL its process group."""
    for action in (None, proc.terminate, lambda: os.killpg(proc.pid, signal.SIGKILL)):
        if action is not None and proc.poll() is None:
            action()
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
