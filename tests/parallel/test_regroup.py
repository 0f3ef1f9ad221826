"""Peer recovery's foundation (issue 46): a rank SIGKILLed mid-step under its keeper is replaced
while its peer lives on; the peer rebuilds the process group with the replacement and hands it its
state; the run ends bit-identical to an uninterrupted one with every step trained once, and the
console says one line. Real processes: the keepers, their workers, a TCPStore, gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshrun.launcher.keeper import keep
from meshrun.parallel import regroup
from tests.conftest import kill_tree, meshrun_env
from tests.parallel.peer_worker import STEPS

WORKER = Path(__file__).with_name("peer_worker.py")
ROOT = Path(__file__).parents[2]
# job -> (a spare started ahead, the ranks killed at their steps), and the (step, rank copied from) of
# its recoveries: rank 1 lost at step 2, then rank 0 at step 4, which takes its state from rank 1's
# replacement (a keeper knows only its own rank's deaths: the store says which generation is next)
RECOVERED = {"replaced": (False, "1:2,0:4"), "spare": (True, "1:3")}
RECOVERIES = {"replaced": [(2, 0), (4, 1)], "spare": [(3, 0)]}
TIMEOUT = 150  # seconds for one job: ~15 s on a quiet machine, ~30 s at load 14 on 2 cores


def run_job(out: Path, tmp_path: Path, *, spare: bool = False, **env: str) -> list[subprocess.CompletedProcess]:
    """Two ranks, each a keeper allowed one replacement (`spare`: started ahead), over a store this
    process hosts (the job's store must outlive any worker)."""
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    base = meshrun_env(tmp_path, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), **env)
    keeper = [sys.executable, "-P", "-m", "meshrun.launcher.keeper", "--replacements", "1", *["--spare"] * spare, "--"]
    procs = [
        subprocess.Popen(
            [*keeper, sys.executable, "-P", str(WORKER), str(out)],
            env={**base, "RANK": str(rank), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        ends = [(proc, *proc.communicate(timeout=TIMEOUT)) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_tree(proc.pid)
        pytest.fail(
            f"a rank did not finish in {TIMEOUT} s: " + " | ".join(proc.communicate()[1][-2000:] for proc in procs)
        )
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err) for proc, out, err in ends]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, list]]]:
    tmp = tmp_path_factory.mktemp("regroup")
    uninterrupted = run_job(tmp / "uninterrupted", tmp)
    runs = {"uninterrupted": (tmp / "uninterrupted", uninterrupted)}
    for name, (spare, kills) in RECOVERED.items():
        runs[name] = (tmp / name, run_job(tmp / name, tmp, spare=spare, MESHRUN_TEST_KILL=kills))
    yield runs


def rows(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"steps-{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)  # the first row also runs the three jobs of `runs`, on loaded cores
@pytest.mark.parametrize("replacement", ["replaced", "spare"])
def test_a_killed_rank_is_replaced_from_its_peer_bit_identically(runs, replacement: str) -> None:
    (plain, plain_ends), (out, ends) = runs["uninterrupted"], runs[replacement]
    assert [end.returncode for end in [*plain_ends, *ends]] == [0, 0, 0, 0], [end.stderr[-3000:] for end in ends]
    for rank in range(2):
        final, reference = (torch.load(o / f"final-{rank}.pt", weights_only=True) for o in (out, plain))
        assert all(torch.equal(final[name], reference[name]) for name in reference), rank
        trained = [row["step"] for row in rows(out, rank) if "step" in row]
        assert trained == list(range(STEPS)), rank  # every step once, the replaced rank's too: none retrained
        assert [row["loss"] for row in rows(out, rank) if "loss" in row] == [
            row["loss"] for row in rows(plain, rank)
        ], rank
        recoveries = [row for row in rows(out, rank) if "recovered" in row]
        assert [(row["recovered"], row["source"]) for row in recoveries] == RECOVERIES[replacement], rank


@pytest.mark.parametrize(
    ("replacement", "how"), [("replaced", "starting its replacement"), ("spare", "its spare takes over")]
)
def test_a_recovered_failure_is_one_line(runs, replacement: str, how: str) -> None:
    """One line from the keeper of each rank lost; none from a survivor (no traceback of its broken all-reduce)."""
    lost = {int(kill.split(":")[0]) for kill in RECOVERED[replacement][1].split(",")}
    for rank, end in enumerate(runs[replacement][1]):
        said = f"[meshrun] rank {rank} was killed by SIGKILL; {how} (1 of 1), which takes its state from a replica"
        assert end.stderr.splitlines() == ([said] if rank in lost else []), end.stderr


DIES = (
    "import os, signal, sys; role = os.environ['MESHRUN_WORKER_ROLE'];"
    " role = 'spare:' + sys.stdin.readline().split()[0] if role == 'spare' else role;"
    " print(role, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
)


@pytest.mark.parametrize(
    ("spare", "generations"), [(False, ["first", "replacement"]), (True, ["first", "spare:replacement"])]
)
def test_keeper_passes_on_a_worker_end_and_counts_replacements(capfd, spare: bool, generations: list[str]) -> None:
    """Torch-free: a worker's own exit status ends the keeper; a killed one is replaced at most as
    often as allowed, each start told its role (a spare: its turn on its stdin),
    then the death is the keeper's status; a spare not needed is ended with the keeper."""
    assert keep([sys.executable, "-c", DIES], env={"RANK": "3"}, replacements=1, spare=spare) == 128 + signal.SIGKILL
    out, err = capfd.readouterr()
    assert out.split() == generations
    assert err.splitlines()[-1] == "[meshrun] rank 3 was killed by SIGKILL; no replacement left (1 used)"
    waits = "import os, sys; os.environ['MESHRUN_WORKER_ROLE'] == 'spare' and sys.stdin.readline(); print('done')"
    assert keep([sys.executable, "-c", waits], env={}, replacements=2, spare=spare) == 0
    assert capfd.readouterr().out == "done\n"  # the spare never printed: ended, its turn never came


def test_keeper_is_its_workers_parent_for_their_lifetime(tmp_path: Path) -> None:
    """The worker follows its keeper, not the agent above it (meshrun.launcher.lifetime): killed
    with the keeper, never left training alone."""
    show = "import os; print(os.environ['MESHRUN_PARENT_PID'], os.getppid())"
    env = meshrun_env(tmp_path, MESHRUN_PARENT_PID=str(os.getpid()))
    keeper = [sys.executable, "-P", "-m", "meshrun.launcher.keeper", "--replacements", "0", "--"]
    said = subprocess.run(
        [*keeper, sys.executable, "-c", show], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    parent, actual = said.stdout.split()
    assert parent == actual != str(os.getpid()), said.stderr


def test_keeper_passes_a_stop_request_on(tmp_path: Path) -> None:
    """SIGTERM to the keeper (the agent's stop) reaches the worker, which stops in its own way; its
    status is the keeper's, and no replacement starts."""
    stops = (
        "import signal, sys, threading; signal.signal(signal.SIGTERM, lambda *a: sys.exit(print('stopped', flush=True)));"
        " print('ready', flush=True); threading.Event().wait(30); sys.exit(9)"
    )
    keeper = [sys.executable, "-P", "-m", "meshrun.launcher.keeper", "--replacements", "1", "--"]
    proc = subprocess.Popen(
        [*keeper, sys.executable, "-c", stops], env=meshrun_env(tmp_path), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0 and proc.stdout.read() == "stopped\n"


def test_release_drops_the_groups_a_device_mesh_holds() -> None:
    """regroup.release reads DeviceMesh's private `_pg_registry` (every group a mesh and the meshes
    cut from it made, kept in the root's): this fails by name if a torch upgrade moves them. While
    a mesh holds a gloo group its connections stay open, and a peer blocked on this rank in it
    never notices the loss (a pipeline's other stage, in its gradient all-reduce)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
        flat = world["pp", "dp"]._flatten("all")
        held = list(world._pg_registry.values())
        assert all(any(group is mine for mine in held) for group in (world.get_group("dp"), flat.get_group()))
        regroup.release([world, flat, None])
        assert not world._pg_registry and not flat._pg_registry
    finally:
        dist.destroy_process_group()
