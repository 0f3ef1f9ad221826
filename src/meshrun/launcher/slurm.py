"""Config -> sbatch script: one torchrun agent per node (`srun`), c10d rendezvous on the first
node, and preemption that checkpoints, requeues and resumes.

The bash lives in one file, `slurm.sbatch` next to this module (package data; `launch/slurm.sbatch`
is a link to it): the generic script, taking the config and overrides as script arguments.
`render_sbatch` writes the script for one config (`meshrun slurm`): its own #SBATCH header, then
the template's job part unchanged, so the two cannot drift. Each node's job step runs `meshrun
train` with the multi-node flags, so the torchrun command line is built only in
`meshrun.launcher.torchrun` (under `launch.recovery: peer` each worker under its keeper, which
replaces it alone: issue 46).

Preemption: Slurm sends USR1 to the batch shell `signal_seconds` before the time limit (or on
`scancel --signal=USR1 --batch JOB`). torchrun does not handle USR1, so the shell's trap sends
SIGTERM to each node's `meshrun train`, which relays it through torchrun to its workers; the workers
agree on a step, checkpoint and exit. The shell then requeues the job; the requeued job runs the
same command, which resumes from the newest checkpoint in the same run_dir (train.resume=auto).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from meshrun.config.schema import Config
from meshrun.config.topology import workers_per_node
from meshrun.errors import ConfigError

# Where the generic script's own header ends and the job every script shares begins.
BODY_MARKER = "# ---- the job: `meshrun slurm` scripts share everything below with this file ----\n"


def template() -> str:
    """The generic sbatch script, package data (`launch/slurm.sbatch` links to it)."""
    return resources.files("meshrun.launcher").joinpath("slurm.sbatch").read_text()


def _body() -> str:
    """The job part of the template: what every rendered script runs after its own header."""
    return template().split(BODY_MARKER, 1)[1]


# What each user-given #SBATCH value may look like: a value is one token of a header line, so a
# newline (a new directive, or a shell command after the header) or a stray quote never gets in.
_FORMATS = {
    "--time": (
        r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE",
        "minutes, H:MM:SS or D-HH:MM:SS, e.g. 4:00:00 (0: no limit)",
    ),
    "--partition": (r"[\w.-]+(,[\w.-]+)*", "partition names of letters, digits, _ . -, separated by commas"),
    "--account": (r"[\w.-]+", "letters, digits, _ . -"),
    "--mem": (r"\d+[KMGT]?", "megabytes, or a number with K, M, G or T, e.g. 64G (0: all of each node's memory)"),
    "--job-name": (r"[\w.+@:,= -]+", "letters, digits, spaces and _ . + @ : , = -"),
    "--sbatch": (
        r"--[a-z][a-z0-9-]*(=((?![\"'\\])[!-~])+)?",
        "one long option with no spaces or quotes, e.g. --sbatch=--qos=high",
    ),
}


def checked(flag: str, value: str) -> str:
    """`value` for the #SBATCH line of `flag`, refused with the expected format if it does not fit."""
    pattern, expected = _FORMATS[flag]
    if not re.fullmatch(pattern, value, flags=re.IGNORECASE if flag in ("--time", "--mem") else 0):
        raise ConfigError(f"{flag} {json.dumps(value)} is not valid for an #SBATCH line: expected {expected}")
    return value


def time_limit_seconds(value: str) -> int | None:
    """sbatch's --time in seconds: minutes, MM:SS, H:MM:SS, D-H, D-H:MM, D-H:MM:SS (None: unlimited,
    which Slurm also reads from 0)."""
    if value.upper() in ("UNLIMITED", "INFINITE") or not any(c.isdigit() and c != "0" for c in value):
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-H, D-H:MM, D-H:MM:SS
        hours, minutes, seconds = [*parts, 0, 0][:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 3:  # H:MM:SS
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)  # minutes, or MM:SS


def partition_cpus(partition: str | None) -> int | None:
    """CPUs of the smallest node of `partition` (None: the default partition), as `sinfo` reports them
    from the login node; None where sinfo is missing, fails or says nothing usable."""
    argv = ["sinfo", "--noheader", "--format=%c", *([f"--partition={partition}"] if partition else [])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(word.rstrip("+")) for word in done.stdout.split() if word.rstrip("+").isdigit()]
    return min(counts) if done.returncode == 0 and counts and min(counts) > 0 else None


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
    node_cpus: int | None = None,
    mem: str | None = None,
    job_name: str = "meshrun",
    signal_seconds: int = 300,
    sbatch_options: Sequence[str] = (),
) -> str:
    """The sbatch script that trains `cfg` (loaded from `config` + `overrides`) on `nodes` nodes.
    `node_cpus`: the CPUs of the partition's smallest node (`partition_cpus`), which the one agent task
    per node asks for unless `cpus_per_task` says otherwise; unknown: one per worker. `mem`: sbatch's
    --mem (None: 0, all of each node's memory). The header says what was chosen and why (`chosen`)."""
    world = cfg.world_size
    nproc = workers_per_node(cfg.parallel, nodes, named=f"--nodes {nodes}", change="--nodes")
    if gpus_per_node and gpus_per_node != nproc:
        raise ConfigError(
            f"{world} workers ({cfg.layout.axes_text()}) on {nodes} nodes is {nproc} per node, but --gpus-per-node is "
            f"{gpus_per_node}; use --gpus-per-node {nproc} or change --nodes / the parallel degrees"
        )
    if gpus_per_node < 0 or signal_seconds < 1:
        raise ConfigError("--gpus-per-node must be >= 0 (0: CPU only) and --signal-seconds >= 1")
    cpus, cpus_why = _cpus(cpus_per_task, node_cpus, nproc)
    mem_option, mem_why = _mem(mem, sbatch_options)
    limit = time_limit_seconds(checked("--time", time)) if time is not None else None
    if limit is not None and signal_seconds >= limit:
        raise ConfigError(
            f"--signal-seconds {signal_seconds} is not below the --time limit ({limit} s): the stop signal would come "
            "before the job starts training; lower --signal-seconds or raise --time"
        )
    name = checked("--job-name", job_name)
    options = [
        f'--job-name="{name}"' if " " in name else f"--job-name={name}",  # sbatch strips the quotes
        f"--nodes={nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the workers
        *([f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        f"--cpus-per-task={cpus}",  # the agent's task holds its workers' CPUs (srun passes it on)
        *([mem_option] if mem_option else []),
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
        (
            f"# meshrun job rendered by `meshrun slurm`: run_dir {json.dumps(str(cfg.run_dir))}, {world} workers "
            f"({cfg.layout.text()}) = {nodes} nodes x {nproc}."
        ),
        "# Submit with `sbatch THIS_FILE`; see launch/slurm.sbatch for the environment it reads.",
        f"{CHOSEN}--cpus-per-task={cpus}: {cpus_why}",
        f"{CHOSEN}{mem_option or '--mem'}: {mem_why}",
        *(f"#SBATCH {option}" for option in options),
        "",
        f"MESHRUN_ARGS=({' '.join(shlex.quote(a) for a in train_args)})",
        f"NPROC_PER_NODE={nproc}",
        f"MAX_RESTARTS={cfg.launch.max_restarts}",
        "",
        "",
    ]
    return "\n".join(head) + _body()


CHOSEN = "# chosen: "  # the header's lines that say what meshrun picked and why (printed by `meshrun slurm`)


def chosen(script: str) -> list[str]:
    """What `render_sbatch` chose for the job's resources and why, one line each, from its header."""
    return [line.removeprefix(CHOSEN) for line in script.splitlines() if line.startswith(CHOSEN)]


def _cpus(requested: int | None, node_cpus: int | None, nproc: int) -> tuple[int, str]:
    """--cpus-per-task of the one task per node, and why: Slurm's default of one CPU per task would
    be shared by every worker of the node."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--cpus-per-task must be >= 1, got {requested}; or leave it out for one per worker")
        return requested, "as given"
    if node_cpus is not None:
        return node_cpus, (
            f"every CPU of the partition's smallest node (sinfo), for its {nproc} worker(s) and their data loading; "
            "pass --cpus-per-task to ask for fewer"
        )
    return nproc, "one per worker (sinfo gave no node size); pass --cpus-per-task to give the workers more"


def _mem(mem: str | None, sbatch_options: Sequence[str]) -> tuple[str | None, str]:
    """The --mem line (None: the user's --sbatch sets memory) and why. Default 0, all of each node's
    memory: the node's one task holds every worker, and a site's per-CPU default (often a few GB)
    would have the kernel kill a job that loads a model in every worker."""
    if mem is not None:
        return f"--mem={checked('--mem', mem)}", "as given"
    if any(option.startswith("--mem") for option in sbatch_options):
        return None, "set by your --sbatch option"
    return "--mem=0", (
        "all of each node's memory, which its one task shares among the workers (a site's per-CPU default "
        "could kill the job); pass --mem to ask for less"
    )


NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/scratch/local", "/local")


def slurm_notes(cfg: Config, *, nodes: int, time: str | None) -> list[str]:
    """Warnings about a rendered job that is valid but may not do what is meant (for stderr)."""
    notes = []
    run_dir = Path(cfg.run_dir).absolute()
    local = [str(Path(p)) for p in (*NODE_LOCAL, os.environ.get("TMPDIR", "/tmp"))]
    if nodes > 1 and any(run_dir.is_relative_to(p) for p in local):
        notes.append(
            f"warning: run_dir {run_dir} looks node-local, but {nodes} nodes write checkpoint shards there and the "
            "requeued job resumes from it; use shared storage (e.g. your home or project folder)"
        )
    if time is not None and time_limit_seconds(time) is None:
        notes.append(
            f"--time {time}: no time limit, so no checkpoint before one; a stop signal (preemption, "
            "scancel --signal=USR1 --batch) still checkpoints"
        )
    return notes


if __name__ == "__main__":
    print(template(), end="")


def submit(script: str) -> str:
    """Submit a rendered sbatch script; returns the job id Slurm gave it."""
    try:
        done = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ConfigError("sbatch not found; run on a Slurm login node, or drop --submit and save the script") from None
    if done.returncode != 0:
        raise ConfigError(f"sbatch failed: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]  # --parsable: "jobid[;cluster]"
