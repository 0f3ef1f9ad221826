"""`meshrun slurm` never writes a value that escapes its #SBATCH line, and refuses what `meshrun
train` would refuse before the job waits for nodes. Pure: no Slurm cluster is needed."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_meshrun

from meshrun.config.schema import load_config
from meshrun.errors import ConfigError
from meshrun.launcher.slurm import render_sbatch

INJECTED = "\n#SBATCH --wrap=id\nrm -rf ~"
BASE = ["slurm", "--set=parallel.dp=1", "--set=parallel.pp=2", "--nodes=2", "--gpus-per-node=1"]


def refused(args: list[str], tmp_path: Path) -> str:
    """Run the CLI; assert exit 2, nothing on stdout (no script), one line on stderr; return it."""
    result = run_meshrun(args, tmp_path=tmp_path, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--partition", "gpu" + INJECTED, "--partition"),
        ("--account", "lab" + INJECTED, "--account"),
        ("--time", "banana", "--time \"banana\" is not valid"),
        ("--job-name", "train" + INJECTED, "--job-name"),
        ("--sbatch", "--qos=high" + INJECTED, "--sbatch"),
        ("--cpus-per-task", "-4", "--cpus-per-task must be >= 1"),
    ],
)
def test_cli_refuses_values_that_would_escape_the_header(flag: str, value: str, message: str, tmp_path: Path) -> None:
    assert message in refused([*BASE, f"{flag}={value}"], tmp_path)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.num_layers=1"], "model.num_layers"),
        (["model.factory=no_such_module:build"], "model.factory"),
        (["run_dir=a_file"], "run_dir"),
    ],
)
def test_cli_runs_the_train_preflight(overrides: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("not a folder\n")
    assert message in refused([*BASE, *(f"--set={o}" for o in overrides)], tmp_path)


def test_stop_signal_must_come_before_the_time_limit(tmp_path: Path) -> None:
    """USR1 due 3600 s before a 10-minute limit would stop the job before it trains: refused;
    every --time format is read in seconds the way sbatch reads it."""
    from meshrun.launcher.slurm import time_limit_seconds

    message = refused([*BASE, "--time=0:10:00", "--signal-seconds=3600"], tmp_path)
    assert "--signal-seconds 3600 is not below the --time limit (600 s)" in message
    for value, seconds in [("10", 600), ("10:30", 630), ("1:00:00", 3600), ("2-3", 183600), ("2-3:04", 183840)]:
        assert time_limit_seconds(value) == seconds, value
    assert time_limit_seconds("1-00:00:01") == 86401 and time_limit_seconds("UNLIMITED") is None


def render(**options: object) -> str:
    cfg = load_config(None, ["parallel.dp=1", "parallel.pp=2", "run_dir=runs/x\n#SBATCH --wrap=id"])
    return render_sbatch(cfg, config=None, overrides=[], nodes=2, gpus_per_node=1, **options)


def test_valid_values_render_one_line_each() -> None:
    script = render(
        partition="gpu,debug",
        account="lab-1",
        time="1-12:00:00",
        cpus_per_task=8,
        job_name="my run",
        sbatch_options=["--qos=high", "--constraint=a100&ib", "--exclusive"],
    )
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for expected in (
        "--partition=gpu,debug",
        "--account=lab-1",
        "--time=1-12:00:00",
        "--cpus-per-task=8",
        '--job-name="my run"',
        "--qos=high",
        "--constraint=a100&ib",
        "--exclusive",
    ):
        assert f"#SBATCH {expected}" in header
    assert "--wrap" not in "\n".join(header)  # the run_dir's newline stays escaped in its comment


@pytest.mark.parametrize(
    "options",
    [
        {"time": "4:00:00\n#SBATCH --wrap=id"},
        {"time": ""},
        {"partition": "a b"},
        {"account": "x;y"},
        {"job_name": 'say "hi"'},
        {"sbatch_options": ["-q high"]},
        {"sbatch_options": ["--comment=a b"]},
        {"cpus_per_task": 0},
        {"mem": "64x"},
        {"mem": "-1"},
        {"mem": "8G\n#SBATCH --wrap=id"},
    ],
)
def test_render_refuses_bad_values(options: dict) -> None:
    with pytest.raises(ConfigError, match="--"):
        render(**options)


def test_cpus_per_task_default_one_per_worker_and_srun_passes_it_on() -> None:
    """Slurm's default is one CPU per task: the one agent task's workers would all share it.
    srun (Slurm >= 22.05) does not inherit --cpus-per-task from sbatch, so the step asks for it."""
    cfg = load_config(None, ["parallel.dp=4", "parallel.pp=2"])
    script = render_sbatch(cfg, config=None, overrides=[], nodes=2, gpus_per_node=4)
    assert "#SBATCH --cpus-per-task=4" in script.splitlines()
    srun = next(line for line in script.splitlines() if line.startswith("srun --kill-on-bad-exit"))
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in srun


def test_python_starts_without_the_working_folder_on_its_path() -> None:
    """The script runs in the submit folder (shared storage): a yaml.py there must not be imported."""
    cfg = load_config(None, ["parallel.dp=4", "parallel.pp=2"])
    script = render_sbatch(cfg, config=None, overrides=[], nodes=2, gpus_per_node=4)
    assert '"$PYTHON" -P -m meshrun train' in script
    assert not [line for line in script.splitlines() if " -m meshrun" in line and " -P -m meshrun" not in line]


def test_mem_and_cpus_per_task_are_set_and_said_with_why() -> None:
    """--mem defaults to 0 (all of each node's memory; a site's per-CPU default could kill the job),
    is left out when an --sbatch option sets memory (sbatch refuses --mem with --mem-per-cpu), and
    the header says what was chosen for it and for --cpus-per-task, and why."""
    from meshrun.launcher.slurm import chosen

    script = render()
    assert "#SBATCH --mem=0" in script.splitlines()
    assert chosen(script) == [
        "--cpus-per-task=1: one per worker (sinfo gave no node size); pass --cpus-per-task to give the workers more",
        (
            "--mem=0: all of each node's memory, which its one task shares among the workers (a site's per-CPU "
            "default could kill the job); pass --mem to ask for less"
        ),
    ]
    sized = render(mem="64G", node_cpus=32)
    assert "#SBATCH --mem=64G" in sized.splitlines() and "--mem=64G: as given" in chosen(sized)
    assert chosen(sized)[0].startswith("--cpus-per-task=32: every CPU of the partition's smallest node (sinfo)")
    site = render(sbatch_options=["--mem-per-cpu=4G"])
    assert not any(line.startswith("#SBATCH --mem=") for line in site.splitlines())


def test_time_zero_is_no_limit_said_in_one_line(tmp_path: Path) -> None:
    """`--time 0` is Slurm's "no limit": rendered, with one line that no limit means no checkpoint before one."""
    result = run_meshrun([*BASE, "--time=0"], tmp_path=tmp_path, timeout=60)
    assert "#SBATCH --time=0" in result.stdout.splitlines()
    notes = [line for line in result.stderr.splitlines() if "--time 0" in line]
    assert len(notes) == 1 and "no time limit" in notes[0], result.stderr


def test_node_local_run_dir_on_many_nodes_is_warned(tmp_path: Path) -> None:
    result = run_meshrun([*BASE, "--set=run_dir=/tmp/meshrun-node-local"], tmp_path=tmp_path, timeout=60)
    assert "#SBATCH --nodes=2" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "node-local" in line]
    assert len(warnings) == 1 and "/tmp/meshrun-node-local" in warnings[0], result.stderr
    one_node = ["slurm", "--set=parallel.dp=1", "--set=parallel.pp=2", "--nodes=1", "--gpus-per-node=2"]
    result = run_meshrun([*one_node, "--set=run_dir=/tmp/meshrun-node-local"], tmp_path=tmp_path, timeout=60)
    assert "node-local" not in result.stderr  # one node: its own disk is the shared storage
