"""Config -> sbatch script: one torchrun agent per node (`srun`), c10d rendezvous on the first
node, and preemption that checkpoints, requeues and resumes.

`render_sbatch` writes the script for one config (`meshrun slurm`); `template()` is the generic
`launch/slurm.sbatch` (config and overrides as script arguments). Both share `_BODY`, so the
two cannot drift; `python -m meshrun.launcher.slurm > launch/slurm.sbatch` regenerates the file.

Preemption: Slurm sends USR1 to the batch shell `signal_seconds` before the time limit (or on
`scancel --signal=USR1 --batch JOB`). torchrun does not handle USR1, so the shell's trap sends
SIGTERM to each node's torchrun agent, which forwards it to its workers; the workers
agree on a step, checkpoint and exit. The shell then requeues the job; the requeued job runs the
same command, which resumes from the newest checkpoint in the same run_dir (train.resume=auto).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from meshrun.config import Config
from meshrun.errors import ConfigError

RDZV_HOST_ENV = "MESHRUN_RDZV_HOST"  # where node names do not resolve (or resolve to the wrong interface)

_BODY = """\
set -uo pipefail

# The run directory (run_dir, relative to here) must be on storage every node shares:
# all ranks write checkpoint shards there and the requeued job resumes from it.
cd "${MESHRUN_WORKDIR:-$SLURM_SUBMIT_DIR}" || exit 1

# Rendezvous on the first node of the allocation. MESHRUN_RDZV_HOST overrides it where node
# names do not resolve or resolve to the wrong network (e.g. MESHRUN_RDZV_HOST=127.0.0.1 when
# all "nodes" are one machine); the port follows the job id so jobs sharing a node do not clash.
HEAD="${MESHRUN_RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}"
PORT="${MESHRUN_RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
PYTHON="${MESHRUN_PYTHON:-python3}"  # an interpreter with meshrun installed, on every node
# After a torchrun restart, a TCPStore shared with the agent keeps stale addresses (pytorch #135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

echo "meshrun: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST," \\
    "$SLURM_JOB_NUM_NODES nodes x $NPROC_PER_NODE workers, rendezvous $HEAD:$PORT"

# Runs on every node (srun, one task per node): the torchrun agent, with its wrapper's pid in a
# node-local file so the USR1 trap can signal exactly this process. Slurm's own signalling
# (scancel --signal, preemption) reaches every process of a step, helpers such as wandb's
# service included; torchrun passes SIGTERM only to its workers' process groups. A stop on
# request ends with status 0, so srun does not kill the other nodes while they checkpoint.
export AGENT_PIDS="${TMPDIR:-/tmp}/meshrun-$SLURM_JOB_ID-agent"  # + ".$SLURM_NODEID"
agent() {
    local pid status stopping=0
    trap 'stopping=1; kill -TERM "$pid" 2>/dev/null' TERM
    "$@" &
    pid=$!
    echo $$ > "$AGENT_PIDS.$SLURM_NODEID"
    while true; do
        wait "$pid"
        status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    rm -f "$AGENT_PIDS.$SLURM_NODEID"
    if [[ "$stopping" == 1 ]]; then
        echo "meshrun: agent on $SLURMD_NODENAME stopped on request (torchrun status $status)" >&2
        return 0
    fi
    return "$status"
}
export -f agent

# USR1 (the --signal warning): torchrun would die of USR1, so send SIGTERM to each node's agent;
# torchrun passes it to the workers, which checkpoint at the next step boundary and exit.
# A SIGTERM reaching this shell must not kill it before srun is done: it is only noted.
preempted=0
on_usr1() {
    [[ "$preempted" == 1 ]] && return
    preempted=1
    echo "meshrun: USR1 received: asking the workers to checkpoint and stop" >&2
    srun --overlap --ntasks-per-node=1 bash -c 'kill -TERM "$(cat "$AGENT_PIDS.$SLURM_NODEID")"'
}
trap on_usr1 USR1
trap 'echo "meshrun: SIGTERM received; waiting for the workers" >&2' TERM

# One torchrun agent per node (--ntasks-per-node=1); each starts NPROC_PER_NODE workers.
srun --kill-on-bad-exit=1 bash -c 'agent "$@"' agent \\
    "$PYTHON" -m torch.distributed.run \\
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$NPROC_PER_NODE" \\
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts="$MAX_RESTARTS" \\
    -m meshrun train "${MESHRUN_ARGS[@]}" &
srun_pid=$!
# `wait` returns early when the trap runs; keep waiting until the checkpoint is written.
while true; do
    wait "$srun_pid"
    status=$?
    kill -0 "$srun_pid" 2>/dev/null || break
done

if [[ "$preempted" == 1 ]]; then
    echo "meshrun: workers stopped (status $status); requeueing job $SLURM_JOB_ID to resume" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
"""

_TEMPLATE_HEAD = """\
#!/usr/bin/env bash
# meshrun on Slurm: one torchrun agent per node, c10d rendezvous on the first node, and
# preemption that checkpoints, requeues and resumes. `meshrun slurm CONFIG --nodes N
# --gpus-per-node G` writes this script for one config; this generic copy takes the config as
# arguments, and every #SBATCH default below can be overridden on the sbatch command line:
#
#   sbatch --nodes=2 --gpus-per-node=8 [--partition=P] [--account=A] [--time=4:00:00] \\
#       launch/slurm.sbatch CONFIG [--set key=value ...]
#
# parallel.dp x parallel.pp must equal nodes x NPROC_PER_NODE (default: GPUs on the node).
# Environment read here (sbatch passes the submitting shell's environment on):
#   NPROC_PER_NODE     workers per node (default $SLURM_GPUS_ON_NODE, else 1)
#   MAX_RESTARTS       torchrun restarts after a failure, each resuming (default 0)
#   MESHRUN_WORKDIR    where run_dir is resolved (default: the submit directory; shared storage)
#   MESHRUN_RDZV_HOST  rendezvous host (default: first node of the allocation)
#   MESHRUN_RDZV_PORT  rendezvous port (default 20000 + job id mod 20000)
#   MESHRUN_PYTHON     interpreter with meshrun installed (default python3)
#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME  the network interface, on nodes with several
#SBATCH --job-name=meshrun
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

if [[ $# -lt 1 ]]; then
    echo "usage: sbatch [options] launch/slurm.sbatch CONFIG [--set key=value ...]" >&2
    exit 2
fi
MESHRUN_ARGS=("$(realpath "$1")" "${@:2}")
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"

"""


# What each user-given #SBATCH value may look like: a value is one token of a header line, so a
# newline (a new directive, or a shell command after the header) or a stray quote never gets in.
_FORMATS = {
    "--time": (r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE", "minutes, H:MM:SS or D-HH:MM:SS, e.g. 4:00:00"),
    "--partition": (r"[\w.-]+(,[\w.-]+)*", "partition names of letters, digits, _ . -, separated by commas"),
    "--account": (r"[\w.-]+", "letters, digits, _ . -"),
    "--job-name": (r"[\w.+@:,= -]+", "letters, digits, spaces and _ . + @ : , = -"),
    "--sbatch": (r"--[a-z][a-z0-9-]*(=((?![\"'\\])[!-~])+)?", "one long option with no spaces or quotes, e.g. --sbatch=--qos=high"),
}


def checked(flag: str, value: str) -> str:
    """`value` for the #SBATCH line of `flag`, refused with the expected format if it does not fit."""
    pattern, expected = _FORMATS[flag]
    if not re.fullmatch(pattern, value, flags=re.IGNORECASE if flag == "--time" else 0):
        raise ConfigError(f"{flag} {json.dumps(value)} is not valid for an #SBATCH line: expected {expected}")
    return value


def template() -> str:
    """The generic `launch/slurm.sbatch`."""
    return _TEMPLATE_HEAD + _BODY


def render_sbatch(
    cfg: Config,
    *,
    config: str | Path | None,
    overrides: list[str],
    nodes: int,
    gpus_per_node: int,
    partition: str | None = None,
    account: str | None = None,
    time: str | None = None,
    cpus_per_task: int | None = None,
    job_name: str = "meshrun",
    signal_seconds: int = 300,
    sbatch_options: list[str] = (),
) -> str:
    """The sbatch script that trains `cfg` (loaded from `config` + `overrides`) on `nodes` nodes."""
    world = cfg.world_size
    if nodes < 1 or world % nodes:
        raise ConfigError(
            f"--nodes {nodes} must divide parallel.dp x parallel.pp ({cfg.parallel.dp} x {cfg.parallel.pp} = {world}); "
            "change --nodes or the parallel degrees"
        )
    nproc = world // nodes
    if gpus_per_node and gpus_per_node != nproc:
        raise ConfigError(
            f"{world} workers (parallel.dp x parallel.pp) on {nodes} nodes is {nproc} per node, but --gpus-per-node is "
            f"{gpus_per_node}; use --gpus-per-node {nproc} or change --nodes / the parallel degrees"
        )
    if gpus_per_node < 0 or signal_seconds < 1:
        raise ConfigError("--gpus-per-node must be >= 0 (0: CPU only) and --signal-seconds >= 1")
    if cpus_per_task is not None and cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task must be >= 1, got {cpus_per_task}; or leave it out for Slurm's default")
    name = checked("--job-name", job_name)
    options = [
        f'--job-name="{name}"' if " " in name else f"--job-name={name}",  # sbatch strips the quotes
        f"--nodes={nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the workers
        *([f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task is not None else []),
        *([f"--partition={checked('--partition', partition)}"] if partition is not None else []),
        *([f"--account={checked('--account', account)}"] if account is not None else []),
        *([f"--time={checked('--time', time)}"] if time is not None else []),
        f"--signal=B:USR1@{signal_seconds}",  # warn the batch shell before the time limit
        "--requeue",  # let the job requeue itself after checkpointing
        "--open-mode=append",  # the requeued run appends to the same log
        "--output=slurm-%x-%j.out",
        *(checked("--sbatch", option) for option in sbatch_options),
    ]
    train_args = [*([str(Path(config).resolve())] if config is not None else []), *(f"--set={o}" for o in overrides)]
    head = [
        "#!/usr/bin/env bash",
        f"# meshrun job rendered by `meshrun slurm`: run_dir {json.dumps(str(cfg.run_dir))}, {world} workers (dp {cfg.parallel.dp} x "
        f"pp {cfg.parallel.pp}) = {nodes} nodes x {nproc}.",
        "# Submit with `sbatch THIS_FILE`; see launch/slurm.sbatch for the environment it reads.",
        *(f"#SBATCH {option}" for option in options),
        "",
        f"MESHRUN_ARGS=({' '.join(shlex.quote(a) for a in train_args)})",
        f"NPROC_PER_NODE={nproc}",
        f"MAX_RESTARTS={cfg.launch.max_restarts}",
        "",
        "",
    ]
    return "\n".join(head) + _BODY


if __name__ == "__main__":
    print(template(), end="")
