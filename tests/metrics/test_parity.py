"""`meshrun parity` through the real CLI: two layouts of one job are equal within the fp32
tolerances; a layout that drops a layer's gradient is not, and the verdict names the step and the
tensor; input that cannot be compared is refused in one line (exit 2) before anything trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import meshrun_env, plant_hostile_modules, run_meshrun, tiny
from dropped_grad_gpt import DROPPED

HERE = str(Path(__file__).parent)  # dropped_grad_gpt.py


def parity(tmp_path: Path, data_dir: Path, *args: str, env: dict[str, str] | None = None, check: bool = False):
    both = tiny(data_dir, "unused")  # parity sets each run's run_dir (OUT/a, OUT/b)
    return run_meshrun(
        ["parity", *both, "--out", str(tmp_path / "parity"), "--steps", "4", *args],
        tmp_path=tmp_path,
        env=env,
        check=check,
        timeout=300,
    )


def step_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line[:5].strip().isdigit()]


def test_dp2_pp2_equals_one_process(tmp_path: Path, data_dir: Path) -> None:
    """Run in a folder holding a yaml.py and a torch.py: neither parity's runs, nor their torchrun
    agents, nor the workers import them (python -P)."""
    ran = plant_hostile_modules(tmp_path)
    done = parity(tmp_path, data_dir, "--set-a", "parallel.dp=2", "--set-a", "parallel.pp=2", check=True)
    assert "A: dp 2 (ddp) x tp 1 x pp 2 (1f1b), micro_batch" in done.stdout and "B: dp 1 x tp 1 x pp 1, " in done.stdout
    rows = step_rows(done.stdout)
    assert [row[0] for row in rows] == ["1", "2", "3", "4"] and all(row[-1] == "ok" for row in rows)
    assert all(float(row[3]) <= 1e-5 and float(row[6]) <= 1e-5 for row in rows)  # loss, grad norm relative
    assert "verdict: EQUAL within the fp32 tolerances (4 steps, " in done.stdout
    for side in ("a", "b"):
        assert (tmp_path / "parity" / side / "metrics.jsonl").is_file()
    assert ran() == []


def test_a_layout_that_drops_a_gradient_is_named(tmp_path: Path, data_dir: Path) -> None:
    env = meshrun_env(tmp_path, PYTHONPATH=HERE)
    factory = "--set=model.factory=dropped_grad_gpt:build"  # drops the gradient under torchrun only
    done = parity(tmp_path, data_dir, factory, "--set-a", "parallel.pp=2", env=env)
    assert done.returncode == 1, done.stderr
    rows = step_rows(done.stdout)
    assert rows[0][-2:] == ["NORM", "DIFFER"] and float(rows[0][3]) <= 1e-5  # the loss of step 1 is still equal
    verdict = done.stdout.strip().splitlines()[-1]
    assert verdict.startswith("verdict: DIFFERENT: first at step 1 (grad norm ")
    assert f"after step 1 (the first step whose weights differ) the tensor that differs most is {DROPPED}" in verdict
    table = done.stdout.split("weights after step 1:")[1].splitlines()
    assert table[3].split()[0] == DROPPED and table[3].endswith("DIFFERS") and not table[4].endswith("DIFFERS")


def test_two_jobs_or_a_used_folder_are_refused_before_training(tmp_path: Path, data_dir: Path) -> None:
    done = parity(tmp_path, data_dir, "--set-b", "model.dim=64", "--set-b", "model.num_heads=2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "A and B are not one job: model.dim is 32 in A and 64 in B" in done.stderr
    assert not (tmp_path / "parity" / "a").exists()
    (tmp_path / "parity" / "old").mkdir(parents=True)
    done = parity(tmp_path, data_dir)
    assert done.returncode == 2 and "--out" in done.stderr and "exists" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "args,message",
    [  # each trained A for minutes, then B was refused by its own `meshrun train`
        (["--layers", "1", "--set-b", "parallel.pp=2"], "run B (dp 1 x tp 1 x pp 2 (1f1b), micro_batch 2, "),
        (["--set-b", "parallel.pp=2", "--set-b", "train.micro_batch=8"], "schedule 1f1b needs at least"),
    ],
)
def test_a_layout_train_refuses_is_refused_before_either_run_trains(
    args: list[str], message: str, tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.cli import main

    out = tmp_path / "parity"
    assert main(["parity", *tiny(data_dir, "unused"), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "training" not in err, err
    assert not out.exists()


def test_the_same_layout_twice_says_it_checks_repeatability(tmp_path: Path, data_dir: Path) -> None:
    done = parity(tmp_path, data_dir, "--steps", "1", "--weights", "none", check=True)
    assert "A and B have the same layout (dp 1 x tp 1 x pp 1, micro_batch 2, recompute none, fp32)" in done.stderr
    assert "checks that a run repeats itself, not one layout against another" in done.stderr
    assert "verdict: EQUAL" in done.stdout
