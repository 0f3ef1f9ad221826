"""Config -> torchrun argv, and real multi-node jobs: two torchrun agents over loopback and
across two network namespaces, each equal in weights to the same dp x pp job on one node."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import netns
import pytest
from conftest import (
    REPO,
    final_weights,
    max_weight_diff,
    meshrun_env,
    meshrun_in_process,
    plant_hostile_modules,
    read_metrics,
    run_meshrun,
    tiny,
)
from nodes import free_port, run_nodes

from meshrun.config.schema import load_config
from meshrun.launcher.torchrun import torchrun_argv

STEPS = {"train.steps": 6, "train.lr": 3e-3}


# ---- argv (pure) ---------------------------------------------------------------------------


def test_the_agent_is_torchruns_own_main() -> None:
    """meshrun.launcher.agent imports torchrun's main and its SignalException: a torch upgrade that
    moves either fails here, not in a preempted job."""

    done = subprocess.run(
        [sys.executable, "-m", "meshrun.launcher.agent", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--nproc-per-node" in done.stdout and "--rdzv-endpoint" in done.stdout


def test_one_node_uses_a_private_rendezvous() -> None:
    cfg = load_config(None, ["parallel.dp=2", "parallel.pp=2", "launch.max_restarts=3"])
    argv = torchrun_argv(cfg, ["train", "--set=parallel.dp=2"])
    # torchrun, quiet on a stop; -P: not a module of the working folder (the workers: PYTHONSAFEPATH)
    assert argv[:4] == [sys.executable, "-P", "-m", "meshrun.launcher.agent"]
    assert argv[4:] == [
        "--standalone",
        "--nproc-per-node=4",
        "--max-restarts=3",
        "-m",
        "meshrun",
        "train",
        "--set=parallel.dp=2",
    ]


def test_multi_node_uses_c10d_rendezvous_with_workers_split_over_nodes() -> None:
    cfg = load_config(
        None,
        ["parallel.dp=4", "parallel.pp=2", "launch.nnodes=2", "launch.rdzv_endpoint=head:29400", "launch.rdzv_id=77"],
    )
    argv = torchrun_argv(cfg, ["train"])
    assert argv[4:] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29400",
        "--rdzv-id=77",
        "--rdzv-conf=join_timeout=600,read_timeout=600",
        "--nproc-per-node=4",
        "--max-restarts=0",
        "-m",
        "meshrun",
        "train",
    ]


def test_host_node_and_local_address_reach_torchrun() -> None:
    base = [
        "parallel.dp=1",
        "parallel.pp=2",
        "launch.nnodes=2",
        "launch.rdzv_endpoint=10.0.0.1:1234",
        "launch.local_addr=10.0.0.2",
    ]
    guest = torchrun_argv(load_config(None, [*base, "launch.host_node=false"]), ["train"])
    assert (
        "--rdzv-conf=join_timeout=600,read_timeout=600,is_host=0" in guest
        and "--local-addr=10.0.0.2" in guest
        and "--nproc-per-node=1" in guest
    )
    host = torchrun_argv(load_config(None, [*base, "launch.host_node=true"]), ["train"])
    assert "--rdzv-conf=join_timeout=600,read_timeout=600,is_host=1" in host


def test_one_node_with_an_endpoint_still_uses_it() -> None:
    """A fixed endpoint on one node (e.g. a port opened in a firewall) is honoured."""
    argv = torchrun_argv(load_config(None, ["parallel.dp=2", "launch.rdzv_endpoint=127.0.0.1:2000"]), ["train"])
    assert "--standalone" not in argv and "--nnodes=1" in argv and "--rdzv-endpoint=127.0.0.1:2000" in argv


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nnodes=3", "--rdzv-endpoint=h:1"], "launch.nnodes (3) must divide parallel.dp x parallel.pp (2 x 2 = 4)"),
        (["--nnodes=2"], "launch.rdzv_endpoint"),
        (["--nnodes=2", "--rdzv-endpoint=h:1", "--nproc-per-node=4"], "launch.nnodes x launch.nproc_per_node (2 x 4)"),
    ],
)
def test_bad_node_layouts_exit_2_with_one_line(flags: list[str], message: str, tmp_path: Path) -> None:
    result = meshrun_in_process(
        ["train", "--set=parallel.dp=2", "--set=parallel.pp=2", *flags, "--dry-run"], tmp_path=tmp_path, check=False
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_flags_land_in_the_launch_section(tmp_path: Path) -> None:
    result = run_meshrun(
        [
            "train",
            "--set=parallel.dp=2",
            "--nnodes=2",
            "--rdzv-endpoint=h:5",
            "--rdzv-id=j1",
            "--local-addr=10.1.1.1",
            "--no-host-node",
            "--max-restarts=2",
            "--dry-run",
        ],
        tmp_path=tmp_path,
        timeout=60,
    )
    assert (
        "nnodes: 2\n  nproc_per_node: null\n  rdzv_endpoint: h:5\n  rdzv_id: j1\n  local_addr: 10.1.1.1\n"
        "  host_node: false"
    ) in result.stdout
    assert "max_restarts: 2" in result.stdout


# ---- real multi-node jobs --------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_missing_node_is_named_and_given_up_on_in_one_line(data_dir: Path, tmp_path: Path) -> None:
    """--nnodes 2 with one node started said "starting 2 workers" and nothing more: now it says who
    it waits for, where, how many have joined, and gives up after launch.rdzv_timeout with one line and
    no traceback. (8 s: the count is read until a second before the timeout, and the host's agent
    takes a few seconds to open its store on a loaded machine.)"""
    endpoint, layout = f"127.0.0.1:{free_port()}", {"parallel.dp": 2, "parallel.pp": 2}  # 2 workers per node
    env = {k: v for k, v in meshrun_env(tmp_path).items() if k != "OMP_NUM_THREADS"}
    flags = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-timeout=8"]
    result = run_meshrun(
        ["train", *tiny(data_dir, tmp_path / "run", **layout), *flags],
        tmp_path=tmp_path,
        env=env,
        timeout=90,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert f"waiting for the other 1 of 2 nodes at rendezvous {endpoint}" in result.stderr
    assert f"rendezvous {endpoint}: 1 of 2 nodes here" in result.stderr  # counted at the store, not assumed
    assert "giving up after 8 s" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "TCPStore.cpp" not in result.stderr, result.stderr  # no request of the count cut off by the close
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: not all 2 nodes joined the rendezvous") and "within 8 s" in last
    assert "(1 of 2 nodes had joined)" in last
    assert "OMP_NUM_THREADS" not in result.stderr  # set for the workers: no torchrun banner


def test_a_guest_whose_host_never_answers_gives_up_in_one_line(data_dir: Path, tmp_path: Path) -> None:
    """A guest node (--no-host-node) started before its host: it waits launch.rdzv_timeout for the
    host's store (torch's own 60 s read timeout ended it sooner, with a traceback), then one line."""
    endpoint, layout = f"127.0.0.1:{free_port()}", {"parallel.dp": 2}
    flags = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-timeout=3", "--no-host-node"]
    result = run_meshrun(
        ["train", *tiny(data_dir, tmp_path / "run", **layout), *flags], tmp_path=tmp_path, timeout=90, check=False
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    said = f"rendezvous {endpoint} refuses connections (nothing listens there yet): waiting for its host node"
    assert said in result.stderr, result.stderr  # why it waits, said at once, not only at the end
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: not all 2 nodes joined the rendezvous") and "within 3 s" in last
    assert f"({endpoint} refuses connections (nothing listens there yet))" in last


@pytest.mark.parametrize(("rank", "awaited"), [(1, "rank 0"), (0, "the other 1 workers")])
def test_a_worker_whose_peers_never_come_says_so_and_gives_up_at_its_bound(
    rank: int, awaited: str, data_dir: Path, tmp_path: Path
) -> None:
    """A worker started by hand whose rank 0 (or, on rank 0, whose peers) never arrives printed nothing
    for minutes: it says what it waits for and for how long, then gives up at launch.rdzv_timeout."""
    port = free_port()
    env = meshrun_env(tmp_path, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = run_meshrun(
        ["train", *tiny(data_dir, tmp_path / "run", **{"parallel.dp": 2}), "--rdzv-timeout=4"],
        tmp_path=tmp_path,
        env=env,
        timeout=90,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    waiting = (
        f"[meshrun] rank {rank}: waiting for {awaited} at the job's store 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT); "
        "giving up after 4 s (launch.rdzv_timeout, --rdzv-timeout)"
    )
    gave_up = (
        f"meshrun: error: rank {rank}: {awaited} did not reach the job's store at 127.0.0.1:{port} within 4 s "
        "(launch.rdzv_timeout); start every worker with the same MASTER_ADDR and MASTER_PORT, or raise --rdzv-timeout"
    )
    assert result.stderr.splitlines() == [waiting, gave_up]


_references: dict[tuple[int, int], Path] = {}


def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory, dp: int, pp: int) -> Path:
    """The same dp x pp job on one node (torchrun --standalone via `meshrun train`), run once per layout."""
    if (dp, pp) not in _references:
        tmp = tmp_path_factory.mktemp(f"one-node-dp{dp}-pp{pp}")
        layout = {"parallel.dp": dp, "parallel.pp": pp}
        env = meshrun_env(tmp, TMPDIR=str(private_tmp(tmp)))
        run_meshrun(["train", *tiny(data_dir, tmp / "run", **STEPS, **layout)], tmp_path=tmp, env=env)
        assert_nothing_left(tmp)
        _references[(dp, pp)] = tmp / "run"
    return _references[(dp, pp)]


def private_tmp(tmp_path: Path) -> Path:
    """A TMPDIR of the test's own, to see what a launch leaves in its temporary folder."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return tmp_path / "tmp"


def assert_nothing_left(tmp_path: Path) -> None:
    """A launch's temporary files (torchrun's torchelastic_* folders, ...) went with it."""
    assert sorted(p.name for p in private_tmp(tmp_path).iterdir()) == []


def assert_same_as_one_node(run: Path, one_node: Path) -> None:
    assert [row["step"] for row in read_metrics(run) if "loss" in row] == list(range(1, STEPS["train.steps"] + 1))
    assert max_weight_diff(final_weights(run), final_weights(one_node)) < 1e-5


@pytest.mark.timeout(400)
def test_two_agents_over_loopback_with_meshrun_train(
    data_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """dp1 x pp2: one pipeline stage per node, activations cross the node boundary."""
    endpoint, job = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    args = [
        "train",
        *tiny(data_dir, tmp_path / "run", **STEPS, **{"parallel.dp": 1, "parallel.pp": 2}),
        "--nnodes=2",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job}",
    ]
    node = ([sys.executable, "-m", "meshrun", *args], meshrun_env(tmp_path, TMPDIR=str(private_tmp(tmp_path))))
    run_nodes([node, node], cwd=tmp_path)
    assert_nothing_left(tmp_path)
    assert_same_as_one_node(tmp_path / "run", reference(data_dir, tmp_path_factory, 1, 2))


@pytest.mark.timeout(400)
def test_two_agents_over_loopback_with_launch_script(
    data_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """dp2 x pp1 through launch/torchrun.sh: gradient all-reduce crosses the node boundary. Started
    in a folder holding a yaml.py and a torch.py, which no process of the job imports."""
    ran = plant_hostile_modules(tmp_path)
    env = meshrun_env(
        tmp_path,
        NNODES="2",
        NPROC_PER_NODE="1",
        RDZV_ENDPOINT=f"127.0.0.1:{free_port()}",
        RDZV_ID=uuid.uuid4().hex[:8],
        PYTHON=sys.executable,
    )
    argv = [
        "bash",
        str(REPO / "launch" / "torchrun.sh"),
        *tiny(data_dir, tmp_path / "run", **STEPS, **{"parallel.dp": 2, "parallel.pp": 1}),
    ]
    run_nodes([(argv, env), (argv, env)], cwd=tmp_path)
    assert ran() == []
    assert_same_as_one_node(tmp_path / "run", reference(data_dir, tmp_path_factory, 2, 1))


# ---- two hosts: network namespaces joined by a veth pair ---------------------------------------


@pytest.fixture
def two_hosts():
    """Two network namespaces linked by a veth pair (see netns.two_hosts)."""
    yield from netns.two_hosts()


@pytest.mark.timeout(400)
def test_two_hosts_in_network_namespaces(
    two_hosts, data_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """dp1 x pp2 across two network namespaces with their own addresses: the host node binds the
    rendezvous store on its address, each node names its own address and interface."""
    host_addr = two_hosts[0][2]
    common = [
        "train",
        *tiny(data_dir, tmp_path / "run", **STEPS, **{"parallel.dp": 1, "parallel.pp": 2}),
        "--nnodes=2",
        f"--rdzv-endpoint={host_addr}:29400",
        f"--rdzv-id={uuid.uuid4().hex[:8]}",
    ]
    nodes = []
    for i, (ns, veth, addr) in enumerate(two_hosts):
        argv = [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "meshrun",
            *common,
            f"--local-addr={addr}",
            "--host-node" if i == 0 else "--no-host-node",
        ]
        nodes.append((argv, meshrun_env(tmp_path, GLOO_SOCKET_IFNAME=veth)))
    run_nodes(nodes, cwd=tmp_path)
    assert_same_as_one_node(tmp_path / "run", reference(data_dir, tmp_path_factory, 1, 2))
