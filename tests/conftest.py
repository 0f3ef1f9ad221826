"""Shared fixtures: run the real `meshrun` CLI in subprocesses, with timeouts and cleanup.

Every multi-process test goes through `run_meshrun`, which starts the same entry point users
run (torchrun with a free rendezvous port via --standalone), kills the whole process group on
timeout, and returns the completed process for assertions.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from plain_reference import Reference, config_from_set_args, train_plain

from meshrun.data.prepare import prepare

if TYPE_CHECKING:
    from meshrun.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first (tests/file_seconds.json, measured by tests/file_seconds.py):
    `-n 2 --dist loadfile` hands whole files to the two workers in this order, so the last files
    handed out are short ones and both workers finish together (longest-processing-time first)."""
    seconds = json.loads((Path(__file__).with_name("file_seconds.json")).read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable: a file's order kept


WORDS = [
    "the",
    "model",
    "trains",
    "on",
    "bytes",
    "of",
    "text",
    "while",
    "every",
    "stage",
    "of",
    "the",
    "pipeline",
    "holds",
    "a",
    "few",
    "blocks",
    "and",
    "replicas",
    "average",
    "their",
    "gradients",
    "so",
    "that",
    "one",
    "process",
    "and",
    "many",
    "agree",
    "def",
    "return",
    "import",
    "class",
    "for",
    "in",
]


INHERITED_NOT = ("WANDB_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_")  # a test job's own choice, not the caller's


def meshrun_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for a test run: private cache, no inherited launcher or WANDB_* variables
    (the config's tracker.mode decides; `tiny` turns wandb off)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_NOT)}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if "PYTHONPATH" in extra and os.environ.get(
        "PYTHONPATH"
    ):  # test helpers first, the checkout under test still found
        extra["PYTHONPATH"] = f"{extra['PYTHONPATH']}{os.pathsep}{os.environ['PYTHONPATH']}"
    env.update(extra)
    return env


def start_meshrun(args: list[str], *, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python -P -m meshrun ARGS` (its own session, away from pytest's signals); -P: as the
    `meshrun` command does, the working folder is not on the Python path."""
    with _sigint_not_ignored():
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "meshrun", *args],
            cwd=tmp_path,
            env=env or meshrun_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """The job starts with SIGINT's default, as from a terminal, also where pytest runs with SIGINT
    ignored (a shell's `cmd &` without job control ignores it, and children inherit an ignore, not a
    handler): the Ctrl-C tests then saw the job train to its end."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler: the child's exec resets it
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


HOSTILE_MODULES = ("yaml", "torch")


def plant_hostile_modules(folder: Path) -> Callable[[], list[str]]:
    """Put a yaml.py and a torch.py in `folder` (a job's working folder: files from elsewhere)
    that leave a marker when imported; returns what reads the markers (none: nothing ran them)."""
    for name in HOSTILE_MODULES:
        marker = folder / f"{name}.ran"
        (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('imported\\n')\n")
    return lambda: sorted(p.name for p in folder.glob("*.ran"))


def descendants(root: int) -> list[int]:
    """Every process below `root` (torchrun puts each worker in a session of its own, so a
    process-group kill does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(root: int) -> None:
    """SIGKILL a launcher and everything it started."""
    for pid in [root, *descendants(root)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    """Poll `predicate` until it holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def finish_meshrun(proc: subprocess.Popen, *, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    """Wait for a started run; kill its whole process group on timeout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(proc.args[3:])} timed out after {timeout}s\n{err[-4000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(proc.args[3:])} exited {result.returncode}\n{err[-6000:]}")
    return result


def run_meshrun(
    args: list[str], *, tmp_path: Path, timeout: float = 240, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run `python -m meshrun ARGS` to the end (see start_meshrun / finish_meshrun)."""
    return finish_meshrun(start_meshrun(args, tmp_path=tmp_path, env=env), timeout=timeout, check=check)


def meshrun_in_process(args: list[str | Path], *, tmp_path: Path, check: bool = True) -> subprocess.CompletedProcess:
    """`meshrun ARGS` through the CLI's own `main` in this process, for a command that starts no
    worker (plan, export, sample, report, a refusal before any worker, a one-process `train`, which
    meshrun trains in its launcher's process): run_meshrun's code and output without a new
    interpreter's imports (torch, transformers: seconds a call). It runs in `tmp_path` with a
    private cache, one thread and meshrun_env's variables left out, as run_meshrun does; returns the
    exit status and what was printed. torch's thread count, its random state and the environment
    are put back after (plan sets threads, sample and train seed, inductor names its cache): no
    later test sees the call. The process exit itself stays tested by run_meshrun's callers."""
    import torch

    from meshrun.cli import main

    out, err = io.StringIO(), io.StringIO()
    threads, rng, environ = torch.get_num_threads(), torch.random.get_rng_state(), dict(os.environ)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        for key in [k for k in os.environ if k.startswith(INHERITED_NOT)]:  # as meshrun_env leaves them out
            patch.delenv(key)
        patch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        patch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)  # as run_meshrun's process: one thread sums in one order
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([str(arg) for arg in args])
        finally:
            torch.set_num_threads(threads)
            torch.random.set_rng_state(rng)
            for key in set(os.environ) - set(environ):
                del os.environ[key]
            os.environ.update(environ)
    result = subprocess.CompletedProcess(["meshrun", *map(str, args)], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        pytest.fail(f"meshrun {' '.join(result.args[1:])} returned {code}\n{result.stderr[-6000:]}")
    return result


def train_job(
    args: list[str], *, tmp_path: Path, timeout: float = 240, check: bool = True
) -> subprocess.CompletedProcess:
    """`meshrun train ARGS` (`--set=` arguments, as `tiny` writes them): a one-process job without a
    tracker trains in this process, as meshrun trains it in its launcher's process
    (meshrun_in_process); a larger one, or one that starts wandb or TensorBoard (their own threads
    and processes), runs as its own process tree (run_meshrun)."""
    from meshrun.parallel.layout import Layout

    cfg = config_from_set_args(args)
    tracked = cfg.tracker.mode != "disabled" or "tensorboard" in cfg.tracker.backends
    if Layout.of(cfg.parallel).world_size == 1 and not tracked:
        return meshrun_in_process(["train", *args], tmp_path=tmp_path, check=check)
    return run_meshrun(["train", *args], tmp_path=tmp_path, timeout=timeout, check=check)


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` ("64k", "2m") mounted at `folder`: a disk that fills up (CI runs as root);
    unmounted afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    mounted = subprocess.run(mount, check=False, capture_output=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (tests run as root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs."""
    with tmpfs(tmp_path / "disk", "64k") as disk:
        yield disk


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def lopsided_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 lopsided source/target pairs, prepared once per session for every encdec test file."""
    from encdec_reference import prepare_lopsided  # it imports this module's helpers

    return prepare_lopsided(tmp_path_factory)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level dataset prepared once per session from generated text: fixed bytes, so
    numerics tests do not change when the project's sources (or Python's) do."""
    rng, texts = random.Random(0), tmp_path_factory.mktemp("corpus")
    for i in range(20):
        lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) for _ in range(120))
        (texts / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path_factory.mktemp("data") / "bytes"
    prepare([str(texts / "*.txt")], out, val_fraction=0.2)
    return out


def tiny(data_dir: Path, run_dir: Path | str, **overrides: object) -> list[str]:
    """`--set` arguments for a tiny fp32 job on the test dataset (overrides win)."""
    settings: dict[str, object] = {
        "data.dir": data_dir,
        "run_dir": run_dir,
        "model.vocab_size": 256,
        "model.num_layers": 4,
        "model.dim": 32,
        "model.num_heads": 2,
        "model.seq_len": 16,
        "parallel.dp": 1,
        "parallel.pp": 1,
        "train.global_batch": 8,
        "train.micro_batch": 2,
        "train.steps": 4,
        "train.warmup_steps": 1,
        "train.eval_interval": 0,
        "train.log_interval": 1,
        "precision": "fp32",
        "recompute": "none",
        "tracker.mode": "disabled",
        "metrics.plots": False,  # ~1 s of matplotlib per launch; the tests that read the pictures turn it on
    }
    settings.update(overrides)
    return [f"--set={key}={value}" for key, value in settings.items()]


@pytest.fixture(scope="session")
def plain_reference(data_dir: Path) -> Callable[..., Reference]:
    """`plain_reference(**overrides)`: the plain-torch run (see plain_reference.py) of the job
    `tiny(data_dir, ..., **overrides)` describes; computed once per session per settings."""
    cache: dict[str, Reference] = {}

    def get(**overrides: object) -> Reference:
        key = repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = train_plain(config_from_set_args(tiny(data_dir, "unused", **overrides)), data_dir)
        return cache[key]

    return get


def final_weights(run_or_checkpoint: Path) -> dict:
    """The whole model's weights from a run's newest checkpoint (or a checkpoint folder), on one process."""
    from meshrun.cli.use_checkpoint import load_full_model

    return load_full_model(run_or_checkpoint, trust_code=True)[0].state_dict()  # the tests' own factories


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir) if "loss" in row]


def grad_norms(run_dir: Path) -> list[float]:
    """Each logged step's pre-clip gradient norm."""
    return [row["grad_norm"] for row in read_metrics(run_dir) if "grad_norm" in row]


@contextlib.contextmanager
def in_process_trainer(data_dir: Path, run_dir: Path, **overrides: object) -> Iterator[Trainer]:
    """meshrun's real Trainer on a one-process mesh, built by a `Run` as `meshrun train` builds it for dp=pp=1."""
    from meshrun.parallel.layout import Layout
    from meshrun.parallel.mesh import init_mesh, shutdown
    from meshrun.training.run import Run

    mesh = init_mesh(Layout())
    run = None
    try:
        run = Run(config_from_set_args(tiny(data_dir, run_dir, **overrides)), mesh, data_dir)
        yield run.trainer
    finally:
        if run is not None:
            run.close()
        shutdown()
