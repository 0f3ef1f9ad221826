"""Observability, proven on two real runs shared by every test here: TensorBoard files read back
with TensorBoard's own reader, profiler traces, the timeline picture's numbers, `meshrun report`.

`profiled_run`: dp=1 x pp=2 (1F1B, 4 microbatches), 4 steps, metrics to TensorBoard + jsonl (no
wandb although its mode is offline), step 4 traced on every rank and measured for the timeline.
`resumed_run`: a copy of it resumed from its step-2 checkpoint and trained to step 4 again, so the
copy's TensorBoard folder holds steps 3-4 twice unless the resume continues it correctly; its
step 3 is traced on rank 1 only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import read_metrics, run_meshrun, tiny
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# Two torchrun jobs: about a minute each on an idle 2-core machine, but several times that when it
# is shared; the runs' own limits are therefore generous.
pytestmark = pytest.mark.timeout(1200)
RUN_TIMEOUT = 600

SETTINGS = {
    "model.num_layers": 2,
    "parallel.pp": 2,
    "train.steps": 4,
    "train.log_interval": 2,
    "train.eval_interval": 2,
    "checkpoint.interval": 2,
    "tracker.mode": "offline",
    "tracker.backends": "[tensorboard,jsonl]",
    "metrics.peak_tflops": 0.001,
    "profile.steps": "[4]",
    "metrics.plots": True,
}


@pytest.fixture(scope="module")
def profiled_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("profiled")
    run_meshrun(["train", *tiny(data_dir, tmp_path / "run", **SETTINGS)], tmp_path=tmp_path, timeout=RUN_TIMEOUT)
    return tmp_path / "run"


@pytest.fixture(scope="module")
def resumed_run(data_dir: Path, profiled_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("resumed")
    run = tmp_path / "run"
    shutil.copytree(profiled_run, run)
    resume = {
        **SETTINGS,
        "train.resume": run / "checkpoints" / "step-00000002",
        "profile.steps": "[3]",
        "profile.ranks": "[1]",
    }
    run_meshrun(["train", *tiny(data_dir, run, **resume)], tmp_path=tmp_path, timeout=RUN_TIMEOUT)
    return run


def read_tensorboard(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def scalar_rows(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as tag -> [(step, value)], the way TensorBoard stores scalars (float32); the
    file's wall-clock stamp `time` is TensorBoard's own wall_time, not a scalar."""
    rows: dict[str, list[tuple[int, float]]] = {}
    for row in read_metrics(run_dir):
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                rows.setdefault(key, []).append((row["step"], float(np.float32(value))))
    return rows


def assert_same_scalars(run_dir: Path, steps: range) -> None:
    events = read_tensorboard(run_dir)
    expected = scalar_rows(run_dir)
    assert {
        "loss",
        "val_loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "bubble",
        "memory_gb/stage1",
        "time/rank1/wait_s",
        "straggler/ratio",
    } <= expected.keys()
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, rows in expected.items():
        logged = [(event.step, event.value) for event in events.Scalars(tag)]
        assert logged == rows, tag
    assert [step for step, _ in expected["loss"]] == list(steps)


def test_every_jsonl_scalar_is_in_tensorboard(profiled_run: Path) -> None:
    assert_same_scalars(profiled_run, range(2, 5, 2))
    assert not (profiled_run / "wandb").exists()  # tracker.backends left wandb out (its mode is offline)


def test_tensorboard_holds_the_resolved_config(profiled_run: Path) -> None:
    [text] = read_tensorboard(profiled_run).Tensors("config/text_summary")
    markdown = text.tensor_proto.string_val[0].decode()
    assert markdown.startswith("```json\n") and markdown.endswith("\n```")
    assert json.loads(markdown.removeprefix("```json\n").removesuffix("\n```")) == json.loads(
        (profiled_run / "config.json").read_text()
    )


def test_resumed_run_continues_the_log_without_duplicate_steps(resumed_run: Path) -> None:
    """Steps 3-4 were logged by the first run, then trained and logged again after resuming from
    step 2: TensorBoard shows step 4 once, with the resumed run's values (its tokens/s differ)."""
    assert len(list((resumed_run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one folder, two sessions
    assert_same_scalars(resumed_run, range(2, 5, 2))
    texts = read_tensorboard(resumed_run).Tensors("config/text_summary")
    assert [t.step for t in texts] == [0, 2]  # each session's resolved config, at the step it started from


def trace_marks(trace: Path) -> dict[str, list[tuple[float, float]]]:
    """Profiler mark name -> [(start, end)] in microseconds, from a Chrome trace file."""
    marks: dict[str, list[tuple[float, float]]] = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") == "user_annotation":
            marks.setdefault(event["name"], []).append((event["ts"], event["ts"] + event["dur"]))
    return marks


def test_traces_hold_every_microbatch_action_of_the_profiled_step(profiled_run: Path) -> None:
    """Step 4 on both pipeline ranks (= stages here): one step, forward and backward of each of
    the 4 microbatches, all inside the step."""
    assert sorted(p.name for p in (profiled_run / "profile").iterdir()) == ["step4-rank0.json", "step4-rank1.json"]
    for stage in (0, 1):
        marks = trace_marks(profiled_run / "profile" / f"step4-rank{stage}.json")
        [(start, end)] = marks["meshrun.pp:step"]
        actions = {name for name in marks if name.startswith("meshrun.pp:") and name != "meshrun.pp:step"}
        assert actions == {f"meshrun.pp:{stage}{kind}{mb}" for kind in "FB" for mb in range(4)}
        assert all(len(marks[name]) == 1 and start <= marks[name][0][0] <= marks[name][0][1] <= end for name in actions)


def test_only_the_chosen_ranks_and_steps_are_traced(resumed_run: Path) -> None:
    traces = sorted(p.name for p in (resumed_run / "profile").iterdir())
    assert traces == ["step3-rank1.json", "step4-rank0.json", "step4-rank1.json"]  # the last two: the first run's
    assert {f"meshrun.pp:1{kind}{mb}" for kind in "FB" for mb in range(4)} <= trace_marks(
        resumed_run / "profile" / "step3-rank1.json"
    ).keys()


def test_timeline_picture_shows_the_logged_bubble_of_its_step(profiled_run: Path) -> None:
    """pipeline_timeline.png is drawn from pipeline_timeline.json; its bubble is the one logged for
    step 4, and agrees with the one computed independently from the step-4 traces (the profiler's
    records of the same marks, whose spans enclose the timeline's own clock reads)."""
    timeline = json.loads((profiled_run / "pipeline_timeline.json").read_text())
    [logged] = [row["bubble"] for row in read_metrics(profiled_run) if row["step"] == 4 and "bubble" in row]
    assert timeline["step"] == 4 and timeline["bubble"] == logged
    from_traces = []
    for stage in (0, 1):
        marks = trace_marks(profiled_run / "profile" / f"step4-rank{stage}.json")
        [(start, end)] = marks.pop("meshrun.pp:step")
        busy = sum(e - s for name, spans in marks.items() if name.startswith("meshrun.pp:") for s, e in spans)
        from_traces.append(1 - busy / (end - start))
        drawn = timeline["stages"][str(stage)]
        assert sorted(f"{a['kind']}{a['microbatch']}" for a in drawn["actions"]) == sorted(
            f"{kind}{mb}" for kind in "FB" for mb in range(4)
        )
        assert 0.95 * (end - start) <= drawn["wall"] * 1e6 <= end - start + 1  # microseconds
    assert abs(sum(from_traces) / 2 - timeline["bubble"]) < 0.05
    assert 0.0 < timeline["bubble"] < 1.0
    assert (profiled_run / "pipeline_timeline.png").read_bytes().startswith(b"\x89PNG")


def test_timeline_stages_are_on_one_clock(profiled_run: Path) -> None:
    """Each rank timed its step from its own start, so the picture showed stage 1 starting F0
    before stage 0 had finished computing it: on one clock no stage starts a microbatch's
    forward before the previous stage ended it, nor its backward before the next stage's."""
    stages = json.loads((profiled_run / "pipeline_timeline.json").read_text())["stages"]
    span = {
        (int(rank), a["kind"], a["microbatch"]): (a["start"], a["end"])
        for rank, t in stages.items()
        for a in t["actions"]
    }
    for mb in range(4):
        assert span[(1, "F", mb)][0] >= span[(0, "F", mb)][1], (mb, stages)
        assert span[(0, "B", mb)][0] >= span[(1, "B", mb)][1], (mb, stages)


def test_clocks_that_disagree_never_draw_a_forward_before_its_input() -> None:
    """Two machines' clocks 5 ms apart: the later-starting stage is moved to after its input."""
    from meshrun.parallel.timeline import Action, StepTimeline, on_one_clock

    first = StepTimeline([Action(0, "F", 0, 0.000, 0.010)], wall=0.03, epoch_ns=1_000_000_000)
    second = StepTimeline([Action(1, "F", 0, 0.001, 0.011)], wall=0.03, epoch_ns=1_004_000_000)  # looks 5 ms early
    aligned = on_one_clock({0: first, 1: second})
    assert aligned[1].actions[0].start == pytest.approx(0.010) and aligned[1].offset == pytest.approx(0.009)
    assert aligned[0].actions[0].start == 0.0 and aligned[0].offset == 0.0


def table_cells(output: str) -> dict[str, dict[str, str]]:
    """`meshrun report`'s first Markdown table (the summaries) as run -> column -> cell."""
    lines = [line for line in output.split("\n\n")[0].splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]
    return {row["run"]: row for row in rows}


def close(cell: str, value: float, *, decimals: int, scale: float = 1.0) -> bool:
    """A printed cell equals `value` to the digits it prints."""
    return abs(float(cell.rstrip("%")) - value * scale) <= 0.5 * 10**-decimals + 1e-9


def test_report_table_equals_the_runs_summaries(profiled_run: Path, resumed_run: Path, tmp_path: Path) -> None:
    """Two runs of one job, one of them resumed: the table holds their summary.json values."""
    (tmp_path / "a").symlink_to(profiled_run)
    (tmp_path / "b").symlink_to(resumed_run)
    out = run_meshrun(["report", "a", "b", "--out", "curves.png"], tmp_path=tmp_path, timeout=60).stdout
    table = table_cells(out)
    assert sorted(table) == ["a", "b"]
    for name, run in (("a", profiled_run), ("b", resumed_run)):
        summary, cells = json.loads((run / "summary.json").read_text()), table[name]
        assert cells["layout"] == summary["layout"] == "dp 1 x tp 1 x pp 2 (1f1b)"
        assert cells["precision"] == summary["precision"] == "fp32"
        assert close(cells["tokens/s"], summary["tokens_per_s"], decimals=1)
        assert close(cells["MFU"], summary["mfu"], decimals=2, scale=100)
        memory = [float(gb) for gb in cells["peak GB per stage"].split(" / ")]
        assert len(memory) == len(summary["peak_memory_gb_per_stage"]) == 2
        assert all(abs(m - s) <= 5e-4 for m, s in zip(memory, summary["peak_memory_gb_per_stage"]))
        assert close(cells["bubble"], summary["bubble"], decimals=2, scale=100)
        assert close(cells["final loss"], summary["final_loss"], decimals=5)
        assert close(cells["val loss"], summary["final_val_loss"], decimals=5)
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    # a picture name it cannot write (a traceback), or a run's own picture (it was replaced): one line each
    loss_png = (profiled_run / "loss.png").read_bytes()
    for bad, message in (("curves.md", "name a .png"), (str(profiled_run / "loss.png"), "is a file of the run")):
        refused = run_meshrun(["report", "a", "--out", bad], tmp_path=tmp_path, timeout=60, check=False)
        assert refused.returncode == 2 and message in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert (profiled_run / "loss.png").read_bytes() == loss_png


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = run_meshrun(["report", "empty"], tmp_path=tmp_path, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "meshrun: error: empty is not a meshrun run directory (no config.json); pass the run_dir of a training job"
    )
    assert not (tmp_path / "report.png").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "tracker.backends=[wandb,tb]",
            "invalid tracker.backends[1]: use 'wandb', 'tensorboard' or 'jsonl' (got \"tb\")",
        ),
        ("tracker.backends=[jsonl,jsonl]", "invalid tracker.backends: name each backend once (got ['jsonl', 'jsonl'])"),
        ("profile.steps=[0]", "invalid profile.steps[0]: Input should be greater than or equal to 1 (got 0)"),
        (
            "profile.memory_snapshot=true",
            ("invalid profile: profile.memory_snapshot needs profile.steps (the steps to snapshot), e.g. [5]"),
        ),
    ],
)
def test_observability_settings_are_checked(override: str, message: str) -> None:
    from meshrun.config.schema import load_config
    from meshrun.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert str(error.value) == message


def test_profiled_ranks_must_exist(tmp_path: Path) -> None:
    from meshrun.config.schema import load_config
    from meshrun.errors import ConfigError
    from meshrun.preflight import check_observability

    with pytest.raises(ConfigError, match=r"^profile.ranks \[4\] do not exist: ranks are 0 to 3 "):
        check_observability(load_config(None, ["profile.ranks=[0,4]", "parallel.dp=2", "parallel.pp=2"]))


def test_a_measured_step_is_timed_by_its_own_stamps_without_a_profiler() -> None:
    """The timeline of a measured step comes from the marks' own clock reads (no profiler, which
    would slow the step it measures); steps not measured record nothing."""
    import time

    import torch

    from meshrun.parallel import timeline

    def run_step(work_s: float) -> None:
        with timeline.step():
            with timeline.action(0, "F", 0):
                time.sleep(work_s)
            time.sleep(0.02)  # waiting: the bubble

    with timeline.measuring(torch.device("cpu")):
        run_step(0.02)
    measured = timeline.last_measured()
    run_step(0.05)  # not measured: the last measured step stays
    assert timeline.last_measured() is measured
    [action] = measured.actions
    assert (action.stage, action.kind, action.microbatch) == (0, "F", 0)
    assert 0.02 <= action.end - action.start < measured.wall
    assert 0.04 <= measured.wall < 1.0 and 0.0 < measured.bubble < 0.6
    assert abs(measured.epoch_ns - time.time_ns()) < 60e9
