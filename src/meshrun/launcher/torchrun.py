"""Config -> torchrun argv (one node on a free local port, or many nodes through c10d
rendezvous), and running it: the signals the launcher passes on, the endings no worker recorded."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, MutableMapping
from pathlib import Path

from meshrun.checkpoint.paths import what_a_rerun_does
from meshrun.config.schema import Config
from meshrun.config.topology import peer_recovery
from meshrun.data.locations import cache_root
from meshrun.errors import RunError
from meshrun.launcher.lifetime import wait_for_session
from meshrun.launcher.outcome import STOP_SIGNALS, Interrupted, Outcome, StoppedBeforeTraining, status_text
from meshrun.launcher.run_lock import RunDirLock

# torchrun's agent shares its TCPStore with the workers by default; after a restart the store
# keeps stale addresses and gloo fails to connect (pytorch #135712). Not sharing it is reliable.
# Python's `-P` for the processes torchrun starts (`python -m` would put the working folder first
# on sys.path, where any `yaml.py` or `torch.py` there would run in every worker); a user's
# model.factory module is found through PYTHONPATH. The agent, parity's runs and the Slurm script
# pass -P themselves (Python >= 3.11: an older one refuses the flag instead of ignoring it).
SAFE_PATH = {"PYTHONSAFEPATH": "1"}
WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **SAFE_PATH}
AGENT = "meshrun.launcher.agent"
KEEPER = "meshrun.launcher.keeper"  # launch.recovery peer: the process the agent starts for a rank
RDZV_TIMEOUT_EXIT = 3  # the agent's status when not all nodes joined within launch.rdzv_timeout
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
LAUNCH_TMP_PREFIX = "meshrun-run-"  # a launch's own TMPDIR (run_tmpdir): this + 8 random characters


def inductor_cache(env: MutableMapping[str, str]) -> str:
    """Where torch.compile's inductor caches: `env`'s TORCHINDUCTOR_CACHE_DIR as the user set it,
    else meshrun's per-user cache folder, set into `env` (see parallel/compile.py for why there).
    Set before the workers start: torch writes its own default (/tmp) into the environment as soon
    as torch._dynamo loads."""
    return env.setdefault(INDUCTOR_CACHE_ENV, str(cache_root() / "inductor"))


def torchrun_argv(cfg: Config, worker_args: list[str]) -> list[str]:
    """The torchrun command for this node; `worker_args` are `meshrun` arguments for each worker.

    One node without an endpoint: `--standalone` (a private rendezvous on a free port). Otherwise
    c10d rendezvous at `launch.rdzv_endpoint`: every node runs the same command (only `local_addr`
    and `host_node` differ), and torchrun numbers the nodes as they join.
    """
    launch = cfg.launch
    argv = [sys.executable, "-P", "-m", AGENT]  # torch.distributed.run, without a traceback on a stop
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        argv.append("--standalone")
    else:
        argv += [
            f"--nnodes={launch.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            f"--rdzv-id={launch.rdzv_id}",
        ]
        # then the agent ends in one line (meshrun.launcher.agent); read_timeout: how long a node waits
        # for the host's store to answer (torch's default, 60 s, failed a node started before its host)
        conf = [f"join_timeout={launch.rdzv_timeout}", f"read_timeout={launch.rdzv_timeout}"]
        if launch.host_node is not None:  # the host binds the store; the others only connect
            conf.append(f"is_host={int(launch.host_node)}")
        argv.append(f"--rdzv-conf={','.join(conf)}")
        if launch.local_addr is not None:
            argv.append(f"--local-addr={launch.local_addr}")
    argv.append(f"--nproc-per-node={cfg.nproc_per_node}")
    if peer_recovery(cfg.parallel, launch):  # each worker under its keeper, which replaces it alone
        return [*argv, "--max-restarts=0", *keeper_argv(cfg, worker_args)[2:]]  # torchrun runs its python
    return [*argv, f"--max-restarts={launch.max_restarts}", "-m", "meshrun", *worker_args]


def keeper_argv(cfg: Config, worker_args: list[str], *, replacing: bool = False) -> list[str]:
    """A keeper's command (launch.recovery peer) for a worker running `meshrun` with `worker_args`;
    `replacing`: its first worker replaces one lost with its node (launcher/returning.py)."""
    launch = cfg.launch
    keeper = [sys.executable, "-P", "-m", KEEPER, f"--replacements={launch.max_restarts}"]
    keeper += ["--spare"] * launch.warm_spare + ["--replacing"] * replacing
    return [*keeper, "--", sys.executable, "-P", "-m", "meshrun", *worker_args]


def worker_env(cfg: Config) -> dict[str, str]:
    """The environment torchrun's workers get on top of this process's: OMP_NUM_THREADS set
    explicitly (this node's CPUs shared out over its workers) unless the user set it, so torchrun
    neither prints its banner nor pins every worker to one thread. Under peer recovery the workers
    use the agent's store, which outlives any of them (not rank 0's, which dies with it), and
    torchrun never restarts them (the keepers replace one), so #135712 cannot arise."""
    env = {**os.environ, **(SAFE_PATH if peer_recovery(cfg.parallel, cfg.launch) else WORKER_ENV)}
    inductor_cache(env)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // cfg.nproc_per_node))
    return env


@contextlib.contextmanager
def run_tmpdir(env: MutableMapping[str, str]) -> Iterator[str]:
    """A folder this launch creates under the system's temporary folder (the user's TMPDIR) and
    sets as `env`'s TMPDIR, for torchrun's agent and its workers: what torch leaves in a temporary
    folder (the agent's torchelastic_* folders, ...) is removed with it when the launch ends. Only
    this folder is removed, never anything meshrun did not create."""
    folder = tempfile.mkdtemp(prefix=LAUNCH_TMP_PREFIX)
    env["TMPDIR"] = folder
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def waiting_line(cfg: Config) -> str:
    """Who a multi-node launch waits for, where, and for how long."""
    launch = cfg.launch
    return (
        f"waiting for the other {launch.nnodes - 1} of {launch.nnodes} nodes at rendezvous {launch.rdzv_endpoint} "
        f"(id {launch.rdzv_id}); giving up after {launch.rdzv_timeout} s (launch.rdzv_timeout, --rdzv-timeout)"
    )


def timeout_message(cfg: Config, state: str) -> str:
    """The one line for a rendezvous that did not gather every node in time; `state`: where it stood."""
    launch = cfg.launch
    return (
        f"not all {launch.nnodes} nodes joined the rendezvous at {launch.rdzv_endpoint} (id {launch.rdzv_id}) within "
        f"{launch.rdzv_timeout} s ({state}); start the same `meshrun train` with this --rdzv-endpoint and --rdzv-id on every "
        "node, check that they reach this endpoint, or raise --rdzv-timeout"
    )


def in_launched_worker() -> bool:
    """True inside torchrun / Slurm-started workers (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_torchrun_ending(run_dir: Path, outcome: Outcome | None, code: int, relayed: list[int]) -> int | None:
    """Raise for the endings that no worker's record explains: Ctrl-C (Interrupted, unless the
    workers completed or stopped first), a stop relayed before any worker acted on it, torchrun's
    agent killed by a signal (its workers died with it: 128 + the signal). Returns the stop
    signal relayed to the workers (None: none)."""
    interrupted = signal.SIGINT in relayed or (code == 128 + signal.SIGINT and not relayed)  # the agent's own
    if interrupted and outcome not in (Outcome.COMPLETED, Outcome.STOPPED):
        raise Interrupted(run_dir)
    stop = next((sig for sig in relayed if sig in STOP_SIGNALS), None)
    if outcome is None and stop is not None:  # no worker acted on it: nothing was checkpointed
        raise StoppedBeforeTraining(stop)
    if outcome is None and code < 0:
        killed = RunError(
            f"torchrun's agent was {status_text(code)} and its workers ended with it; {what_a_rerun_does(run_dir)}"
        )
        killed.exit_code = 128 - code
        raise killed
    return stop


def run_torchrun(argv: list[str], *, env: dict[str, str], lock: RunDirLock) -> tuple[int, list[int]]:
    """Run torchrun's agent in a session of its own, so that a terminal's Ctrl-C reaches it only
    through this process, the same way as a signal sent to this process alone: SIGINT is passed
    on as SIGINT (torchrun ends its workers at once, nothing saved), a stop request (a container's
    PID 1, a scheduler) as SIGTERM (torchrun passes it on to its workers, which checkpoint and
    stop; it has no handler for SIGUSR1 and would die of it). A SIGINT this process ignores (a
    job started in the background by a script) stays ignored. `lock`: the run_dir's, which the
    agent holds too and names as a holder (meshrun.launcher.run_lock). Returns torchrun's exit status (-N: killed by
    signal N) and the signals passed on, in order."""
    proc = subprocess.Popen(argv, env=env, pass_fds=() if lock.fd is None else (lock.fd,), start_new_session=True)
    lock.add_holder(proc.pid, "its torchrun agent")
    relayed: list[int] = []

    def relay(signum: int, frame: object) -> None:
        relayed.append(signum)
        proc.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    relays = [*STOP_SIGNALS, *([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])]
    previous = {sig: signal.signal(sig, relay) for sig in relays}
    try:
        code = proc.wait()
        if code < 0:  # killed: its workers end with it, after it
            wait_for_session(proc.pid)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, relayed
