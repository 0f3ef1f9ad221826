"""`meshrun plan` through the real CLI: the ranked table, `--write`, bad input (exit 2, one
line, nothing written), `--calibrate` on this machine and `--run` against a finished run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, meshrun_env, read_metrics, run_meshrun, tiny, train_job

from meshrun import cli
from meshrun.config.schema import load_config
from meshrun.hardware.peaks import SHORT_NAMES, device_by_short_name

TINY_MODEL = [
    "--set=model.num_layers=2",
    "--set=model.dim=32",
    "--set=model.num_heads=2",
    "--set=model.seq_len=16",
    "--set=train.global_batch=4",
    "--set=train.micro_batch=1",
    "--set=precision=fp32",
]


def plan(tmp_path: Path, *args: str, check: bool = True, model: tuple[str, ...] = tuple(TINY_MODEL)):
    """`meshrun plan` with a private cache: XDG_CACHE_HOME in tmp_path, and no inductor cache folder
    inherited from this pytest process (a test that compiled in-process set one into its environment)."""
    env = {k: v for k, v in meshrun_env(tmp_path).items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return run_meshrun(["plan", *model, *args], tmp_path=tmp_path, timeout=180, check=check, env=env)


def table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line[:3].strip().isdigit()]


def test_table_ranks_layouts_and_writes_the_best(tmp_path: Path) -> None:
    out = tmp_path / "best.yaml"
    done = plan(tmp_path, "--gpus=2", "--gpu=h100", f"--write={out}", "--top=50")
    rows = table_rows(done.stdout)
    assert rows and all(row[17] == "yes" for row in rows)  # 2 x 80 GiB holds every layout of a tiny model
    layouts = {(row[1], row[2], row[4], row[22]) for row in rows}  # tp, dp, pp, cp
    assert layouts == {("1", "1", "2", "1"), ("1", "2", "1", "1"), ("2", "1", "1", "1"), ("1", "1", "1", "2")}
    assert {row[23] for row in rows} == {"-", "on"}  # on a GPU, offload's layouts too
    assert {row[3] for row in rows} == {"ddp", "fsdp"}  # dp 2: both data-parallel modes
    times = [float(row[18]) for row in rows]
    terms = [line for line in done.stdout.splitlines() if line.startswith("  pp rank ")]
    assert terms and all("activations" in t and "buffers" in t and "baseline" in t for t in terms)
    assert times == sorted(times)
    best = load_config(out)
    first = rows[0]
    assert (best.parallel.tp, best.parallel.dp, best.parallel.pp, best.train.micro_batch, best.recompute) == (
        int(first[1]),
        int(first[2]),
        int(first[4]),
        int(first[6]),
        first[8],
    )
    assert (best.parallel.cp, best.train.offload_activations is not False) == (int(first[22]), first[23] == "on")
    assert best.train.global_batch == 4 and best.model.dim == 32


def test_layouts_that_do_not_fit_are_marked_and_not_written(tmp_path: Path) -> None:
    out = tmp_path / "best.yaml"
    done = plan(tmp_path, "--gpu=h100", "--memory-gb=0.0001", f"--write={out}", check=False)
    assert done.returncode == 2 and "no layout fits" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert " NO " in done.stdout and not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu=h900"], "unknown GPU 'h900'"),
        (["--gpus=3", "--nodes=2", "--gpu=h100"], "--nodes (2) must divide --gpus (3)"),
        (["--margin=1.5", "--gpu=h100"], "--margin must be in [0, 1)"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    done = plan(tmp_path, *args, check=False)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_shipped_llama_plans_only_the_tp_its_kv_heads_allow(tmp_path: Path) -> None:
    """configs/llama-tiny.yaml has 2 kv heads: training refuses tp 4 (whole kv heads per rank), so
    a plan of 4 GPUs ranks tp 1 and 2 (it once traced tp 4 and crashed in k_proj's view)."""
    config = str(REPO / "configs" / "llama-tiny.yaml")
    done = plan(tmp_path, "--gpus=4", "--gpu=h100", "--top=1000", model=(config,))
    assert {row[1] for row in table_rows(done.stdout)} == {"1", "2"}


@pytest.mark.parametrize(
    ("config", "task"),
    [
        (
            "classify-tiny.yaml",
            "task classification (vocab 256, 8 labels; head and loss priced on its output, 8 per sample",
        ),
        (
            "forecast-tiny.yaml",
            "task regression (2 features per step, forecasts 7 steps; head and loss priced on its output, 7 x 2",
        ),
    ],
)
def test_every_task_is_planned_and_named(config: str, task: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped classifier and forecaster plan as a language model does, tp included (both
    models take GPT's block split); the plan says which task it priced."""
    assert cli.main(["plan", str(REPO / "configs" / config), "--gpus=2", "--gpu=h100", "--top=50"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"meshrun plan: {task}")
    rows = table_rows(out)
    layouts = {(row[1], row[2], row[4], row[22]) for row in rows}  # tp, dp, pp, cp: no cp (not a decoder)
    assert layouts == {("1", "1", "2", "1"), ("1", "2", "1", "1"), ("2", "1", "1", "1")}


def test_write_never_overwrites(tmp_path: Path) -> None:
    out = tmp_path / "keep.yaml"
    out.write_text("mine\n")
    done = plan(tmp_path, "--gpu=h100", f"--write={out}", check=False)
    assert done.returncode == 2 and "already exists" in done.stderr and out.read_text() == "mine\n"


def test_every_short_name_is_one_table_entry() -> None:
    assert {device_by_short_name(name).key for name in SHORT_NAMES} == set(SHORT_NAMES.values())
    with pytest.raises(KeyError, match="unknown GPU"):
        device_by_short_name("tpu")


def test_calibrate_then_compare_a_finished_run(tmp_path: Path, data_dir: Path) -> None:
    """Calibrated with train.compile on (explicit on a CPU): the probes run eager but one, run compiled
    (a cold compile, ~25 s on 2 shared cores); then an eager run is compared and a compiled job planned."""
    calibration = tmp_path / "cal.json"
    compiled = "--set=train.compile=true"
    done = plan(tmp_path, "--calibrate", f"--calibration={calibration}", "--steps=1", "--rounds=1", compiled)
    record = json.loads(calibration.read_text())
    assert [p["compile"] for p in record["probes"]].count(True) == 1 and "compiled: x" in done.stdout
    assert 0.2 <= record["compiled_compute"] <= 1.5  # measured (or clamped to the range, with a warning)
    assert any((tmp_path / "cache" / "meshrun" / "inductor").iterdir())  # meshrun's inductor cache, not /tmp
    planned = plan(tmp_path, f"--calibration={calibration}", "--gpus=2", compiled)
    assert f"compiled: x{record['compiled_compute']:.2f} compute (measured" in planned.stdout
    assert record["device"] == "cpu" and record["achieved_flops"] > 0 and record["p2p_s"] >= 0
    layouts = {(probe["dp"], probe["pp"], probe["microbatches"]) for probe in record["probes"]}
    assert {(1, 1, 4), (2, 1, 2), (1, 2, 2), (1, 2, 4)} <= layouts  # two-rank probes ran under torchrun
    assert "GFLOP/s achieved" in done.stdout and "per message" in done.stdout
    assert "calibration round 1/1" in done.stderr and "probe 1/" in done.stderr  # progress as it goes
    assert record["step_s"] >= min(p["optimizer_s"] for p in record["probes"]) > 0  # a measured floor
    assert record["runtime_bytes"] > 100 * 2**20  # a worker's resident torch
    run_dir = tmp_path / "run"
    train_job(tiny(data_dir, run_dir), tmp_path=tmp_path)
    measured = [row["step_time_s"] for row in read_metrics(run_dir) if "step_time_s" in row][1:]
    done = run_meshrun(["plan", "--run", str(run_dir), f"--calibration={calibration}"], tmp_path=tmp_path)
    assert "compile: off (train.compile auto on cpu), eager" in done.stdout
    line = next(line for line in done.stdout.splitlines() if line.startswith("step time s (bubble formula)"))
    predicted, shown, ratio = (float(x) for x in line.split()[-3:])
    assert shown == pytest.approx(sum(measured) / len(measured), rel=1e-3)
    assert predicted > 0 and ratio == pytest.approx(predicted / shown, rel=1e-2)
    line = next(line for line in done.stdout.splitlines() if line.startswith("memory GB, pp rank 0"))
    predicted, shown, ratio = (float(x) for x in line.split()[-3:])
    peak = max(row["memory_gb"] for row in read_metrics(run_dir) if "memory_gb" in row)
    assert shown == pytest.approx(peak, rel=1e-3) and 0.5 < ratio < 2  # the calibrated baseline dominates
    # against an H100's numbers the ratios are huge: every column still reads apart
    done = run_meshrun(["plan", "--run", str(run_dir), "--gpu", "h100"], tmp_path=tmp_path)
    rows = [
        line for line in done.stdout.splitlines() if line.startswith(("step time s", "bubble", "tokens/s", "memory"))
    ]
    assert len(rows) == 4 + 1  # and the memory of the run's one pipeline stage
    for row in (row for row in rows if not row.endswith("-")):  # no bubble measured without a pipeline
        predicted, shown, ratio = (float(x) for x in row.split()[-3:])
        assert ratio == pytest.approx(predicted / shown, rel=1e-2), row


@pytest.mark.parametrize("trust", [[], ["--trust-code"]], ids=["refused", "trusted"])
def test_a_runs_factory_is_imported_only_with_trust_code(trust: list[str], tmp_path: Path) -> None:
    """`plan --run` builds the run's model: a model.factory its config.json names is code from a file."""
    marker = tmp_path / "code-ran"
    (tmp_path / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom meshrun.models.gpt import GPT as build\n"
    )
    cfg = load_config(None, [arg.removeprefix("--set=") for arg in TINY_MODEL] + ["model.factory=planted:build"])
    (tmp_path / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.5}\n{"step": 2, "step_time_s": 0.5}\n')
    env = meshrun_env(tmp_path, PYTHONPATH=str(tmp_path))  # the module is importable: only the flag decides
    done = run_meshrun(
        ["plan", "--run", ".", "--gpu", "h100", *trust], tmp_path=tmp_path, env=env, timeout=180, check=False
    )
    if trust:
        assert marker.exists() and done.returncode == 0 and "tokens/s" in done.stdout, done.stderr
    else:
        assert not marker.exists(), "the run's module was imported"
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "planted:build" in done.stderr and "--trust-code" in done.stderr


def test_write_gives_the_job_a_new_run_dir_and_the_layout_comment(tmp_path: Path) -> None:
    """Running the written config starts a new run: never the source config's run_dir, nor a
    folder that exists (an earlier written job's); the file says which layout it holds."""
    (tmp_path / "runs" / "best").mkdir(parents=True)  # an earlier job written as best.yaml
    out = tmp_path / "best.yaml"
    done = plan(tmp_path, "--gpus=2", "--gpu=h100", f"--write={out}", "--set=run_dir=runs/default")
    written = load_config(out)
    assert written.run_dir == "runs/best-2" and "run_dir runs/best-2" in done.stdout
    assert not (tmp_path / written.run_dir).exists()
    header = [line for line in out.read_text().splitlines() if line.startswith("#")]
    layout = next(line for line in header if line.startswith("# layout: "))
    assert layout.startswith(f"# layout: {written.layout.text()}, ")
    assert f"micro_batch {written.train.micro_batch} x {written.accumulation_steps} microbatches" in layout
    assert any("the source config's was runs/default" in line for line in header)
