"""A run's record is never wrong and never lost (issue 26), on real runs and real files:
every log window's time covers its own steps, validation and checkpoints timed apart; a resumed
run's summary and loss.png cover every segment; `meshrun report` reads what a crash leaves,
refuses what meshrun did not write, and never overwrites a file."""

from __future__ import annotations

import itertools
import json
import shutil
import warnings
from pathlib import Path

import pytest
from conftest import meshrun_env, meshrun_in_process, read_metrics, run_meshrun, tiny

pytestmark = pytest.mark.timeout(900)
SLOW_GPT = Path(__file__).parents[1] / "parallel"  # slow_gpt.py: blocks that sleep a fixed time


def train_rows(run: Path) -> list[dict]:
    return [row for row in read_metrics(run) if "loss" in row]


def test_windows_leave_validation_and_checkpoints_out(data_dir: Path, tmp_path: Path) -> None:
    """Validation (every 2 steps) and checkpoints (every 4) fall inside log windows of 3 steps.
    Blocks sleep (60 ms per block and microbatch, forward + backward), so a step takes ~0.25 s
    whatever the load. Each window's step_time_s must be the wall time between its row and the
    previous one, less the validation and checkpoint seconds logged in between, per step: before
    the fix, a pause reset the window's clock but not its step count (2-3x too fast)."""
    run = tmp_path / "run"
    settings = {
        "model.factory": "slow_gpt:build",
        "model.num_layers": 2,
        "train.micro_batch": 4,
        "train.steps": 9,
        "train.log_interval": 3,
        "train.eval_interval": 2,
        "train.eval_batches": 2,
        "checkpoint.interval": 4,
        "tracker.backends": "[jsonl]",
    }
    env = meshrun_env(tmp_path, PYTHONPATH=str(SLOW_GPT))
    run_meshrun(["train", *tiny(data_dir, run, **settings)], tmp_path=tmp_path, env=env, timeout=600)
    rows = read_metrics(run)
    assert [row["step"] for row in rows if "eval_s" in row] == [2, 4, 6, 8, 9]
    assert [row["step"] for row in rows if "checkpoint_s" in row] == [4, 8, 9]
    windows = [index for index, row in enumerate(rows) if "loss" in row]
    assert [rows[i]["step"] for i in windows] == [3, 6, 9]
    for before, after in itertools.pairwise(windows):
        between = rows[before + 1 : after]
        paused = sum(row.get("eval_s", 0.0) + row.get("checkpoint_s", 0.0) for row in between)
        assert paused > 0
        wall = rows[after]["time"] - rows[before]["time"] - paused
        steps = rows[after]["step"] - rows[before]["step"]
        assert rows[after]["step_time_s"] == pytest.approx(wall / steps, rel=0.3), (rows[before], rows[after])
        assert rows[after]["train_s"] == pytest.approx(rows[after]["step_time_s"] * steps, rel=1e-9)
    summary = json.loads((run / "summary.json").read_text())
    for key in ("eval_s", "checkpoint_s", "train_s"):
        assert summary[key] == pytest.approx(sum(row.get(key, 0.0) for row in rows), rel=1e-9)


@pytest.fixture(scope="module")
def resumed(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 4-step run, then the same command with train.steps=6: it resumes from the step-4
    checkpoint and trains two steps more. The run directory and the resume's stderr."""
    tmp_path = tmp_path_factory.mktemp("resumed")
    run = tmp_path / "run"
    job = {"train.log_interval": 2, "train.eval_interval": 2, "tracker.backends": "[jsonl]"}
    run_meshrun(["train", *tiny(data_dir, run, **job)], tmp_path=tmp_path)
    more = {**job, "train.steps": 6, "metrics.plots": True}
    return run, run_meshrun(["train", *tiny(data_dir, run, **more)], tmp_path=tmp_path).stderr


def test_a_resumed_runs_summary_and_loss_picture_cover_every_segment(resumed: tuple[Path, str]) -> None:
    from meshrun.metrics.plots import plot_loss

    run = resumed[0]
    rows = read_metrics(run)
    windows = [row for row in rows if "loss" in row]
    assert [row["step"] for row in windows] == [2, 4, 6]  # steps 2, 4 by the first segment
    summary = json.loads((run / "summary.json").read_text())
    timed = windows[1:]  # the first window pays for warm-up
    seconds = sum(row["train_s"] for row in timed)
    assert summary["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] * r["train_s"] for r in timed) / seconds)
    assert summary["train_s"] == pytest.approx(sum(row["train_s"] for row in windows))
    assert summary["eval_s"] == pytest.approx(sum(row.get("eval_s", 0.0) for row in rows))
    assert "measured_from_step" not in summary
    plot_loss(rows, run.parent / "expected.png", run=run.name)  # every row of the file, both segments
    assert (run / "loss.png").read_bytes() == (run.parent / "expected.png").read_bytes()


def test_a_longer_schedule_on_resume_is_said_in_one_line(resumed: tuple[Path, str]) -> None:
    from meshrun.config.schema import Config
    from meshrun.training.optim import lr_at

    run, stderr = resumed
    [line] = [line for line in stderr.splitlines() if "lr schedule" in line]
    train = Config.model_validate(json.loads((run / "config.json").read_text())).train
    assert train.steps == 6
    new, old = lr_at(4, train), lr_at(4, train.model_copy(update={"steps": 4}))
    assert new > old  # the 4-step schedule had reached its floor
    assert line == (
        "[meshrun] lr schedule re-stretched from 4 to 6 steps (train.steps changed since the checkpoint): "
        f"lr at step 5 is {new:.3g} instead of {old:.3g}"
    )


def test_a_run_resumed_elsewhere_says_where_its_figures_start(tmp_path: Path) -> None:
    """A checkpoint of another run_dir: no earlier rows here, so the summary says from which step."""
    from meshrun.metrics.report import RunReport
    from meshrun.metrics.trackers import JsonlTracker

    report = RunReport(tmp_path, steps=6, tracker=JsonlTracker(tmp_path / "metrics.jsonl"), start_step=4, plots=False)
    row = {"loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "tflops": 1.0, "step_time_s": 0.5}
    report.log(6, {**row, "train_s": 1.0, "memory_gb": 1.0})
    assert report.run_totals()["measured_from_step"] == 4
    report.close()


def report_run(tmp_path: Path, *runs: str, out: str | None = "curves.png", force: bool = False):
    args = ["report", *runs, *(["--out", out] if out else []), *(["--force"] if force else [])]
    return meshrun_in_process(args, tmp_path=tmp_path, check=False)


def assert_refused(proc, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and all(f in proc.stderr for f in fragments), proc.stderr


def test_report_writes_its_picture_into_the_run_and_says_where(resumed: tuple[Path, str], tmp_path: Path) -> None:
    """No --out: report.png goes into the (first) run's directory, not wherever the command ran, and
    the output names it; a second report replaces it only with --force."""
    run = tmp_path / "run"
    shutil.copytree(resumed[0], run)
    proc = run_meshrun(["report", "run"], tmp_path=tmp_path, timeout=120)
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "report.png").exists()
    assert proc.stdout.rstrip().endswith(f"loss curves: {Path('run', 'report.png')}")
    assert_refused(report_run(tmp_path, "run", out=None), f"{Path('run', 'report.png')} already exists", "--force")
    assert report_run(tmp_path, "run", out=None, force=True).returncode == 0


def test_report_reads_a_torn_last_row_and_refuses_what_meshrun_did_not_write(
    resumed: tuple[Path, str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(resumed[0], run)
    metrics, summary = run / "metrics.jsonl", run / "summary.json"
    written = metrics.read_text()
    lines = len(written.splitlines())
    metrics.write_text(written + '{"step": 7, "loss": 4.1')  # a crash mid-write
    proc = report_run(tmp_path, "run")
    assert proc.returncode == 0, proc.stderr
    assert f"warning: {Path('run') / 'metrics.jsonl'} line {lines + 1} is cut short" in proc.stderr
    assert "| run " in proc.stdout
    plan = run_meshrun(["plan", "--run", "run", "--gpu", "h100"], tmp_path=tmp_path, timeout=300)  # its reader too
    assert f"line {lines + 1} is cut short" in plan.stderr and "step time s" in plan.stdout
    # a broken row before others, or one ended by its newline (written whole): not a crash's doing
    for bad, why in (
        ('{"step": 7, "loss": 4.1\n{"step": 8}\n', "is not JSON"),
        ('{"step": 7, "loss": 4.1\n', "is not JSON"),
        ('{"step": 7, "loss": "low"}\n', "'loss' is 'low'"),
    ):
        metrics.write_text(written + bad)
        assert_refused(report_run(tmp_path, "run", force=True), f"metrics.jsonl line {lines + 1}", why)
    metrics.write_text(written)
    for bad in ("[]", '{"tokens_per_s": "fast"}', '{"steps": 4,'):
        summary.write_text(bad)
        assert_refused(report_run(tmp_path, "run", force=True), "summary.json is not a summary meshrun wrote")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "model": {**config["model"], "seq_len": "16"}}))
    assert_refused(report_run(tmp_path, "run", force=True), "config.json is not a meshrun run's resolved config")


def test_report_never_replaces_a_file_unless_forced(resumed: tuple[Path, str], tmp_path: Path) -> None:
    (tmp_path / "run").symlink_to(resumed[0])
    mine = tmp_path / "curves.png"
    mine.write_bytes(b"not meshrun's")
    assert_refused(report_run(tmp_path, "run"), "--out curves.png already exists", "--force")
    assert mine.read_bytes() == b"not meshrun's"
    assert report_run(tmp_path, "run", force=True).returncode == 0
    assert mine.read_bytes().startswith(b"\x89PNG")
    own = report_run(tmp_path, "run", out=str(resumed[0] / "loss.png"), force=True)  # a run's own file: never
    assert_refused(own, "is a file of the run")


def fake_run(tmp_path: Path, metrics: str) -> Path:
    """A run directory with the config fields `meshrun report` reads and these metrics.jsonl lines."""
    run = tmp_path / "run"
    run.mkdir()
    config = {"parallel": {"dp": 1, "pp": 1}, "train": {"global_batch": 4}, "model": {"seq_len": 8}}
    (run / "config.json").write_text(json.dumps({**config, "precision": "fp32"}))
    (run / "metrics.jsonl").write_text(metrics)
    return run


@pytest.mark.parametrize(
    "metrics,why",
    [
        ('{"step": ' + "9" * 400 + ', "loss": 1.0}\n', "is not a step count"),  # was an OverflowError traceback
        ('{"step": 1, "loss": ' + "9" * 400 + "}\n", "'loss' is 99999"),
        ('{"step": 1, "train_s": -5}\n', "'train_s' is -5, not a finite number >= 0"),
        ('{"step": 1, "train_s": Infinity}\n', "'train_s' is inf, not a finite number >= 0"),
        ('{"step": 1, "time/rank0/compute_s": NaN, "time/rank0/wait_s": 1}\n', "is nan, not a finite"),  # "nan%"
        ('{"step": 1, "straggler/rank": 1}\n', "straggler/pp is missing"),  # was a KeyError traceback
        ('{"step": 1, "straggler/rank": NaN, "straggler/pp": 0, "straggler/dp": 0, "straggler/ratio": 1}\n', "nan"),
        ('{"step": 1, "straggler/rank": 1.5, "straggler/pp": 0, "straggler/dp": 0, "straggler/ratio": 1}\n', "1.5"),
        ('{"step": 1, "loss": "low"}\n', "'loss' is 'low', not a number"),
        ("[1, 2]\n", "a JSON list, not an object"),
        ("null\n", "not an object"),
        ('{"step": true}\n', "step True is not a step count"),
        ('{"step": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "is not JSON (RecursionError)"),
    ],
)
def test_report_refuses_a_hostile_metrics_row_in_one_line(
    metrics: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.cli import main

    code = main(["report", str(fake_run(tmp_path, metrics)), "--out", str(tmp_path / "curves.png")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "metrics.jsonl line 1" in err and why in err, err
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize(
    "metrics",
    [
        '{"step": 1, "loss": NaN}\n{"step": 2, "loss": Infinity}\n',  # a diverged run logs its loss as it was
        '{"step": 1}\n{"step": 2, "train_s": 0.5}\n',  # no loss yet: was a matplotlib legend warning
    ],
)
def test_report_draws_what_a_diverged_or_young_run_logged_without_warnings(
    metrics: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "no artists with labels" reached the user's terminal
        assert main(["report", str(fake_run(tmp_path, metrics)), "--out", str(tmp_path / "curves.png")]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "| run (not finished) |" in out and (tmp_path / "curves.png").is_file()
