"""`precision: auto`: bf16 where the hardware computes it natively, fp32 on a CPU that would
emulate it (8x slower there), explicit values kept (with a warning when bf16 is emulated);
the choice is said once, recorded in config.json and wandb, and an `auto` run resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_meshrun, tiny
from wandb_files import offline_runs, read_run

from meshrun.hardware import precision
from meshrun.hardware.precision import PrecisionChoice, resolve_precision

CPU = torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    """Read independently of meshrun: the CPU flags that make bf16 matmuls native."""
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        [],
    )
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


EXPECTED_AUTO = "bf16" if cpu_has_native_bf16() else "fp32"


@pytest.mark.parametrize(
    "flags,isa_limit,expected",
    [
        ({"avx2", "fma"}, "", "fp32"),
        ({"avx2", "avx512f", "avx512_bf16"}, "", "bf16"),
        ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "", "bf16"),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", "fp32"),  # oneDNN limited below bf16: emulated
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_core_bf16", "bf16"),
    ],
)
def test_auto_on_a_cpu_follows_its_bf16_instructions(
    flags: set[str], isa_limit: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_limit)
    choice = resolve_precision("auto", CPU)
    assert choice.precision == expected
    assert choice.reason.startswith(f"precision auto -> {expected}: this CPU")
    assert choice.warning is None


def test_explicit_precision_wins_and_emulated_bf16_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"avx2"})
    for explicit in ("fp32", "fp16"):
        assert resolve_precision(explicit, CPU) == PrecisionChoice(
            explicit, f"precision {explicit} (set in the config)"
        )
    slow = resolve_precision("bf16", CPU)
    assert slow.precision == "bf16"
    assert "emulated" in slow.warning and "8x slower than fp32" in slow.warning and "precision=auto" in slow.warning
    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert resolve_precision("bf16", CPU).warning is None


def test_auto_on_this_machine_matches_its_cpu_flags() -> None:
    assert resolve_precision("auto", CPU).precision == EXPECTED_AUTO


def test_auto_is_said_once_recorded_and_resumes(data_dir: Path, tmp_path: Path) -> None:
    """Two ranks, one line naming the choice and why; config.json and the wandb config hold the
    resolved precision; running the same `auto` job again continues it (not "a different model")."""
    run_dir = tmp_path / "run"
    first = run_meshrun(
        [
            "train",
            *tiny(
                data_dir,
                run_dir,
                **{"precision": "auto", "parallel.dp": 2, "train.steps": 2, "tracker.mode": "offline"},
            ),
        ],
        tmp_path=tmp_path,
    )
    said = [line for line in first.stderr.splitlines() if "precision auto ->" in line]
    assert len(said) == 1 and f"precision auto -> {EXPECTED_AUTO}: this CPU" in said[0], first.stderr[-2000:]
    assert json.loads((run_dir / "config.json").read_text())["precision"] == EXPECTED_AUTO
    assert read_run(offline_runs(run_dir)[0]).config["precision"] == EXPECTED_AUTO

    again = run_meshrun(
        ["train", *tiny(data_dir, run_dir, **{"precision": "auto", "train.steps": 3})], tmp_path=tmp_path
    )
    assert "resumed from" in again.stderr and "step-00000002" in again.stderr


def test_explicit_bf16_on_an_emulating_cpu_warns_once(data_dir: Path, tmp_path: Path) -> None:
    result = run_meshrun(
        ["train", *tiny(data_dir, tmp_path / "run", **{"precision": "bf16", "parallel.dp": 2, "train.steps": 1})],
        tmp_path=tmp_path,
    )
    warnings = [line for line in result.stderr.splitlines() if "warning: precision bf16" in line]
    assert len(warnings) == (0 if cpu_has_native_bf16() else 1), result.stderr[-2000:]
