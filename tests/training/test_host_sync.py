"""The training step never waits for the device: no tensor value is read on the host inside it.

A dispatch mode counts `aten._local_scalar_dense`, the op behind `.item()`, `bool(t)`, `int(t)`
and `float(t)`: on CUDA each is a device->host sync (bench/host_sync.py checks the same on a
GPU with torch.cuda.set_sync_debug_mode). Non-finite gradients are still never applied: they
are kept on the device, skip the update there, and are reported at the next log step.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from conftest import in_process_trainer
from torch.utils._python_dispatch import TorchDispatchMode

from meshrun.training.nonfinite import NonFiniteLossError

FAULTY = str(Path(__file__).parents[1] / "parallel")


class HostReads(TorchDispatchMode):
    """Records where a tensor's value was handed to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.where.append("".join(traceback.format_stack(limit=10)[:-1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_step_reads_nothing_back(precision: str, data_dir: Path, tmp_path: Path) -> None:
    with in_process_trainer(data_dir, tmp_path / "run", precision=precision, **{"train.steps": 5}) as trainer:
        trainer.train_step(0)  # warm-up: lazy state (optimizer moments) is created here
        with HostReads() as reads:
            for step in range(1, 5):
                trainer.train_step(step)
                trainer.requests.poll()
    assert reads.where == [], "host read inside a training step:\n" + reads.where[0]


def test_counter_sees_the_reads_it_must_catch() -> None:
    """The counter is not blind: the check this change removed from every step shows up."""
    with HostReads() as reads:
        if not torch.isfinite(torch.tensor(1.0)):
            pass
    assert len(reads.where) == 1


def test_non_finite_step_is_never_applied_and_is_named_at_the_next_log(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(FAULTY)
    import faulty_gpt

    # 4 microbatches per step: the 9th backward from now is step 3's first.
    monkeypatch.setenv("MESHRUN_TEST_INF_AT", str(faulty_gpt._calls["backward"] + 9))
    faulty = {
        "model.factory": "faulty_gpt:build",
        "train.steps": 6,
        "train.log_interval": 2,
        "checkpoint.at_end": False,
    }
    with in_process_trainer(data_dir, tmp_path / "bad", **faulty) as trainer:
        with pytest.raises(NonFiniteLossError, match="non-finite loss/gradients at step 3; "):
            trainer.train()
        assert trainer.report.rows and [row["step"] for row in trainer.report.rows] == [
            2
        ]  # raised before logging step 4
        got = {k: v.clone() for k, v in trainer.model.parts[0].state_dict().items()}
        moments = [s["exp_avg"].clone() for s in trainer.optimizers.optimizers[0].state.values()]
        counters = {int(s["step"]) for s in trainer.optimizers.optimizers[0].state.values()}
    with in_process_trainer(data_dir, tmp_path / "good", **{**faulty, "train.steps": 2}) as trainer:
        trainer.train()
        want = trainer.model.parts[0].state_dict()
        want_moments = [s["exp_avg"] for s in trainer.optimizers.optimizers[0].state.values()]
    assert counters == {2}, "AdamW counted a skipped step"
    assert all(torch.equal(got[k], want[k]) for k in want), "a non-finite step (or one after it) touched the weights"
    assert all(torch.equal(a, b) for a, b in zip(moments, want_moments, strict=True))
