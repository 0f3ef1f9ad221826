"""Mixed precision on one process: bf16/fp16 track fp32, fp16 skips overflowing steps,
and a non-finite loss outside fp16 stops the run naming the step."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import losses, meshrun_env, read_metrics, run_meshrun, tiny, train_job

FAULTY = str(Path(__file__).parents[1] / "parallel")  # faulty_gpt.py, dtype_probe_gpt.py
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
STEPS = {"train.steps": 6}


@pytest.fixture(scope="module")
def fp32(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    tmp = tmp_path_factory.mktemp("fp32")
    train_job(tiny(data_dir, tmp / "run", **STEPS), tmp_path=tmp)
    return losses(tmp / "run")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_tracks_fp32(
    precision: str, fp32: list[float], data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(FAULTY)
    from dtype_probe_gpt import recorded

    probe = tmp_path / "dtypes"
    probe.mkdir()
    env = meshrun_env(tmp_path, PYTHONPATH=FAULTY, MESHRUN_TEST_DTYPES=str(probe))
    args = tiny(data_dir, tmp_path / "run", **STEPS, precision=precision, **{"model.factory": "dtype_probe_gpt:build"})
    run_meshrun(["train", *args], tmp_path=tmp_path, env=env)
    assert list(recorded(probe).values()) == [{f"torch.{DTYPES[precision]}"}]  # autocast reached every matmul
    got = losses(tmp_path / "run")
    assert len(got) == len(fp32)
    for a, b in zip(got, fp32):
        assert abs(a - b) / b < 0.02


def test_fp16_overflow_is_skipped_and_counted(data_dir: Path, tmp_path: Path) -> None:
    env = meshrun_env(tmp_path, PYTHONPATH=FAULTY, MESHRUN_TEST_INF_AT="9")  # 4 microbatches/step: step 3
    args = tiny(data_dir, tmp_path / "run", **STEPS, precision="fp16", **{"model.factory": "faulty_gpt:build"})
    run_meshrun(["train", *args], tmp_path=tmp_path, env=env)
    rows = [r for r in read_metrics(tmp_path / "run") if "skipped_steps" in r]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert rows[2]["loss_scale"] == rows[1]["loss_scale"] / 2


def test_non_finite_loss_stops_the_run_naming_the_step(data_dir: Path, tmp_path: Path) -> None:
    env = meshrun_env(tmp_path, PYTHONPATH=FAULTY, MESHRUN_TEST_INF_AT="9")
    args = tiny(data_dir, tmp_path / "run", **STEPS, **{"model.factory": "faulty_gpt:build"})
    result = run_meshrun(["train", *args], tmp_path=tmp_path, env=env, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "meshrun: error: non-finite loss/gradients at step 3; lower train.lr, set train.grad_clip, or use bf16"
    )
