"""A node lost whole under launch.recovery peer (issue 46): dp2 over two network namespaces, a worker
each, the host node `a` holding rank 0 and the job's store; every process in namespace `b` is
SIGKILLed mid-step (its launcher, agent, keeper and worker: nothing is left there to replace
anything). The same `meshrun train` run again in `b` (what a scheduler's requeue or a pod's
restart does) starts its worker as a replacement, which takes rank 1's state from rank 0's memory:
the run equals the one-node uninterrupted run. A node that never comes back ends the run in one
line at launch.rdzv_timeout. Real torchrun, keepers, gloo over a veth pair."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
from conftest import meshrun_env, read_metrics, tiny
from nodes import finish
from peer_runs import HERE, JOB, assert_recovered, train

from meshrun.launcher.failures import read_losses

PAUSE_AT = "5"  # rank 1's forward 5: step 3's first microbatch, rank 0 waiting for it in DDP's all-reduce


@pytest.fixture
def two_hosts():
    yield from netns.two_hosts()


def node_command(
    hosts, i: int, data_dir: Path, tmp: Path, rdzv_timeout: int, on_rank: str = "1"
) -> tuple[list[str], dict[str, str]]:
    """Node `i`'s `meshrun train` of the dp2 job under peer recovery, in its namespace; `on_rank`
    waits at the cue for its node to be killed."""
    (ns, veth, addr), host = hosts[i], hosts[0][2]
    args = ["train", *tiny(data_dir, tmp / "run", **{**JOB, "launch.recovery": "peer"}), "--nnodes=2"]
    args += [f"--rdzv-endpoint={host}:29400", "--rdzv-id=lost-node", f"--rdzv-timeout={rdzv_timeout}"]
    args += [f"--local-addr={addr}", "--host-node" if i == 0 else "--no-host-node"]
    env = meshrun_env(
        tmp,
        PYTHONPATH=HERE,
        GLOO_SOCKET_IFNAME=veth,
        MESHRUN_TEST_PAUSE_AT=PAUSE_AT,
        MESHRUN_TEST_ON_RANK=on_rank,
        MESHRUN_TEST_PAUSED=str(tmp / "paused"),
    )
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "meshrun", *args], env


def start(command: tuple[list[str], dict[str, str]], cwd: Path) -> subprocess.Popen:
    argv, env = command
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def kill_namespace(ns: str, paused: Path, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    """Once the cue's rank waits there (`paused` made), SIGKILL every process in namespace `ns`, until none is left."""
    deadline = time.monotonic() + timeout
    while not paused.exists():
        assert time.monotonic() < deadline, "no rank reached the cue"
        assert all(proc.poll() is None for proc in procs), [proc.communicate()[0][-3000:] for proc in procs]
        time.sleep(0.1)
    while pids := subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True, check=True
    ).stdout.split():
        assert time.monotonic() < deadline, f"processes left in {ns}: {pids}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)


@pytest.mark.timeout(600)  # a one-node run and a two-node run with a node started twice, on loaded cores
def test_a_node_lost_whole_comes_back_as_replacements_and_no_step_is_lost(
    two_hosts, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = train(data_dir, tmp_path / "plain", JOB)
    tmp = tmp_path / "nodes"
    tmp.mkdir()
    commands = [node_command(two_hosts, i, data_dir, tmp, rdzv_timeout=180) for i in (0, 1)]
    procs = [start(command, tmp) for command in commands]
    kill_namespace(two_hosts[1][0], tmp / "paused", procs[:1])
    lost = finish(procs[1:], timeout=30)  # node b's first launcher, killed
    assert procs[1].returncode == -signal.SIGKILL
    back = start(commands[1], tmp)
    said = finish([procs[0], back], timeout=300)
    assert [procs[0].returncode, back.returncode] == [0, 0], said
    assert "was lost from the running job" in said[1], said[1]
    killed = subprocess.CompletedProcess([], 0, "", "\n".join([*said, *lost]))
    assert_recovered({"uninterrupted": plain, "killed": (tmp / "run", killed)}, monkeypatch, events=[(2, "1", 0, 0)])
    assert [(loss.rank, loss.how, loss.replaced) for loss in read_losses(tmp / "run")] == [
        (1, "lost with its node", True)
    ]


@pytest.mark.timeout(400)
def test_a_node_that_never_comes_back_ends_the_run_in_one_line_at_its_bound(
    two_hosts, data_dir: Path, tmp_path: Path
) -> None:
    bound = 30
    commands = [node_command(two_hosts, i, data_dir, tmp_path, rdzv_timeout=bound) for i in (0, 1)]
    procs = [start(command, tmp_path) for command in commands]
    kill_namespace(two_hosts[1][0], tmp_path / "paused", procs[:1])
    killed_at = time.monotonic()
    said = finish(procs, timeout=bound + 120)
    took = time.monotonic() - killed_at
    assert procs[0].returncode == 1, said[0]
    last = said[0].strip().splitlines()[-1]
    assert f"rank 1 lost and not replaced within {bound} s (launch.rdzv_timeout)" in last, said[0]
    assert bound <= took < bound + 90, took
    assert "Traceback" not in said[0]
    assert [row["step"] for row in read_metrics(tmp_path / "run") if "loss" in row] == [1, 2]  # nothing lost


def test_a_returned_node_checks_in_at_the_agents_exit_barrier_for_its_lost_agent() -> None:
    """The private pieces of torchrun's exit barrier that stand_in_at_exit uses (its key, its
    non-blocking half, the rendezvous round's prefix): with the stand-in's check-in, an agent's own
    barrier of two nodes returns at once. Fails by name if a torch upgrade moves them."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.elastic.utils.store import barrier

    from meshrun.config.schema import load_config
    from meshrun.launcher.returning import stand_in_at_exit

    assert "torch.rendezvous.{self._settings.run_id}.{self._state_holder.state.round}" in inspect.getsource(
        DynamicRendezvousHandler._wrap_store
    )
    cfg = load_config(
        None, ["parallel.dp=2", "launch.nnodes=2", "launch.rdzv_endpoint=127.0.0.1:1", "launch.rdzv_id=j"]
    )
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    stand_in_at_exit(store, cfg)
    agents = dist.PrefixStore("torch.rendezvous.j.0", store)
    barrier(agents, world_size=2, key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=5)  # the host agent's


def test_a_record_read_from_the_store_names_only_the_jobs_environment() -> None:
    """The store a returning node reads is on the network: only torchrun's job variables reach its
    workers (a name like LD_PRELOAD is dropped), and a record whose numbers are not this node's
    (a group rank past nnodes, another local world size) is no job of ours: a launch like any other."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from meshrun.config.schema import load_config
    from meshrun.launcher.returning import lost_node

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    cfg = load_config(
        None,
        [
            "parallel.dp=2",
            "parallel.pp=1",
            "launch.nnodes=2",
            "launch.recovery=peer",
            "launch.max_restarts=1",
            f"launch.rdzv_endpoint=127.0.0.1:{store.port}",
            "launch.host_node=false",
        ],
    )
    job = {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    store.set("node", json.dumps({**job, "LD_PRELOAD": "/tmp/hostile.so", "PYTHONPATH": "/tmp/hostile"}))
    assert lost_node(cfg, "node") == job
    for wrong in ({"GROUP_RANK": "2"}, {"GROUP_RANK": "-1"}, {"LOCAL_WORLD_SIZE": "64"}, {"GROUP_RANK": None}):
        store.set("node", json.dumps({**job, **wrong}))
        assert lost_node(cfg, "node") is None, wrong
    store.set("node", "[1, 2]")
    assert lost_node(cfg, "node") is None


@pytest.mark.timeout(400)
def test_the_host_node_lost_ends_the_run_in_one_line(two_hosts, data_dir: Path, tmp_path: Path) -> None:
    """Node `a` (the rendezvous store, torchrun's group rank 0, rank 0) killed whole: the survivor on
    `b` cannot regroup and says why in one line, at once (not at launch.rdzv_timeout)."""
    commands = [node_command(two_hosts, i, data_dir, tmp_path, rdzv_timeout=300, on_rank="0") for i in (0, 1)]
    procs = [start(command, tmp_path) for command in commands]
    kill_namespace(two_hosts[0][0], tmp_path / "paused", procs[1:])
    said = finish(procs, timeout=200)
    assert procs[1].returncode != 0, said[1]
    last = said[1].strip().splitlines()[-1]
    assert "the job's store went with the node that served it (the host node" in last, said[1]
    assert "Traceback" not in said[1]
