"""JobSet pods on one machine for the pods' contract test (test_k8s): each "pod" a process in a
network namespace (netns.two_hosts) with its own UTS and mount namespaces, so it has the
hostname, /etc/hosts, ConfigMap mount and environment Kubernetes gives a JobSet pod, and runs
the manifest's own container command."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_tree, meshrun_env

# Inside the pod's own UTS and mount namespaces (in its network namespace): /etc as an overlay
# whose upper layer holds the pod's hosts file and the ConfigMap's mount, the pod's hostname,
# then the container's command in place of this shell.
POD_SHELL = (
    'mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1,workdir=$2" /etc && hostname "$3" && shift 3 && exec "$@"'
)


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command and args: defined names are replaced, `$$` is a
    literal `$`, anything else stays as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]) if m[1] else "$", text)


class JobSetPods:
    """A JobSet's pods on the network-namespace hosts: hostnames from the JobSet's naming rule
    (<jobset>-<replicatedJob>-<jobIndex>-<podIndex>), /etc/hosts as the kubelet writes it plus the
    headless service's records (each pod's `<hostname>.<subdomain>`, as cluster DNS answers through
    the pod's search path), the ConfigMap at its mountPath, and the environment such a pod gets:
    the Job controller's JOB_COMPLETION_INDEX, HOSTNAME, `added_env` (what a controller adds to the
    container, per pod) and the container's own env."""

    def __init__(
        self,
        config_map: dict,
        container: dict,
        *,
        jobset: str,
        replicated_job: str,
        subdomain: str,
        hosts: list[tuple[str, str, str]],
        workdir: Path,
        added_env: list[dict[str, str]] | None = None,
    ) -> None:
        self.config_map, self.container, self.subdomain = config_map, container, subdomain
        self.hosts, self.workdir, self.attempt = hosts, workdir, 0
        self.hostnames = [f"{jobset}-{replicated_job}-0-{index}" for index in range(len(hosts))]
        self.added_env = added_env or [{} for _ in hosts]

    def etc(self, index: int) -> tuple[Path, Path]:
        """The overlay's upper layer (the pod's own files under /etc) and its work folder."""
        upper, work = (
            self.workdir / f"pod{index}-{self.attempt}" / "etc",
            self.workdir / f"pod{index}-{self.attempt}" / "work",
        )
        work.mkdir(parents=True)
        own = self.hostnames[index]
        lines = [
            "127.0.0.1 localhost",
            f"{self.hosts[index][2]} {own}.{self.subdomain}.default.svc.cluster.local {own}",
        ]
        lines += [f"{addr} {host}.{self.subdomain}" for host, (_, _, addr) in zip(self.hostnames, self.hosts)]
        upper.mkdir(parents=True)
        (upper / "hosts").write_text("\n".join(lines) + "\n")
        (upper / "hostname").write_text(own + "\n")
        (config,) = [m for m in self.container["volumeMounts"] if m["name"] == "config"]
        folder = Path(config["mountPath"])
        assert folder.is_relative_to("/etc"), "the test mounts the ConfigMap through its /etc overlay"
        (upper / folder.relative_to("/etc")).mkdir(parents=True)
        for key, text in self.config_map["data"].items():
            (upper / folder.relative_to("/etc") / key).write_text(text)
        return upper, work

    def env(self, index: int) -> dict[str, str]:
        """The image's environment (this test's interpreter on PATH) plus what Kubernetes sets."""
        bin_dir = str(Path(sys.executable).parent)
        env = meshrun_env(self.workdir, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        env.update(HOSTNAME=self.hostnames[index], JOB_COMPLETION_INDEX=str(index), **self.added_env[index])
        for var in self.container["env"]:
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            else:
                assert var["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, var
                env[var["name"]] = self.hosts[index][2]
        return env

    def start(self) -> list[subprocess.Popen]:
        """Every pod of one JobSet attempt, started at once; output to pod<i>-<attempt>.log."""
        self.attempt += 1
        procs = []
        for index, (ns, _, _) in enumerate(self.hosts):
            upper, work = self.etc(index)
            env = self.env(index)
            argv = [expand(a, env) for a in [*self.container["command"], *self.container["args"]]]
            pod = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private"]
            log = open(self.log(index), "w")  # noqa: SIM115 (the child holds it; closed below)
            procs.append(
                subprocess.Popen(
                    [*pod, "sh", "-c", POD_SHELL, "pod", str(upper), str(work), self.hostnames[index], *argv],
                    cwd=self.workdir,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
        return procs

    def log(self, index: int) -> Path:
        return self.workdir / f"pod{index}-{self.attempt}.log"

    def delete(self, procs: list[subprocess.Popen], *, grace: float = 60) -> None:
        """What deleting a pod does: SIGTERM to the container's process, SIGKILL after the grace period."""
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            kill_tree(proc.pid)  # workers live in sessions of their own
            proc.wait()


def wait_for(condition, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
