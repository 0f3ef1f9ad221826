"""`meshrun plan --calibrate`'s fit, without timing anything: step times that a known set of
constants predicts for the probes are fitted back, and the fitted constants must give those
constants and the same predictions for layouts no probe ran (interleaved, GPipe, dp=2 with more
microbatches, recompute in a pipeline). Deterministic: profiles are traced under fake tensors."""

from __future__ import annotations

import dataclasses

import pytest

from meshrun.config.schema import Config, load_config
from meshrun.planner.calibrate import fit_constants, probe_layouts
from meshrun.planner.cost import Efficiency, Hardware
from meshrun.planner.search import predict, with_layout

CPU = Hardware("cpu", float("inf"), None, intra_gbs=10.0, inter_gbs=1.25, gpus_per_node=2)
MACHINE = Efficiency(
    achieved_flops=3e9, action_s=2e-3, recompute_cost=1.7, step_s=5e-3, p2p_s=4e-4, parallel_devices=1.6
)
UNPROBED = [  # (dp, pp, schedule, micro_batch, recompute)
    (1, 2, "interleaved-1f1b", 1, "none"),
    (1, 2, "gpipe", 2, "none"),
    (2, 1, "1f1b", 1, "none"),
    (1, 2, "1f1b", 2, "full"),
    (1, 1, "1f1b", 8, "every:2"),
]


@pytest.fixture(scope="module")
def cfg() -> Config:
    settings = ["model.num_layers=4", "model.dim=32", "model.num_heads=2", "model.seq_len=16"]
    return load_config(None, [*settings, "train.global_batch=8", "precision=fp32"])


def fitted(layouts: list[Config], eff: Efficiency, *, shared_machine: bool = True) -> Efficiency:
    """The fit of the step times `eff` predicts for `layouts`."""
    return fit_constants(layouts, seconds(layouts, eff), CPU, precision="fp32", shared_machine=shared_machine)


def seconds(layouts: list[Config], eff: Efficiency) -> list[float]:
    return [predict(layout, CPU, eff, precision="fp32", margin=0.0).time.total for layout in layouts]


def test_probes_cover_one_and_two_ranks(cfg: Config) -> None:
    shapes = {
        (c.parallel.dp, c.parallel.pp, c.accumulation_steps, c.recompute) for c in probe_layouts(cfg, max_ranks=2)
    }
    assert {(2, 1, 2, "none"), (1, 2, 2, "none"), (1, 2, 8, "none"), (1, 1, 8, "full")} <= shapes
    assert all(c.world_size == 1 for c in probe_layouts(cfg, max_ranks=1))


@pytest.mark.parametrize("parallel_devices", [1.6, None], ids=["slower-together", "full-speed-together"])
def test_fit_recovers_the_constants_and_their_predictions(cfg: Config, parallel_devices: float | None) -> None:
    machine = dataclasses.replace(MACHINE, parallel_devices=parallel_devices)
    fit = fitted(probe_layouts(cfg, max_ranks=2), machine)
    for field in ("achieved_flops", "action_s", "recompute_cost", "step_s", "p2p_s"):
        assert getattr(fit, field) == pytest.approx(getattr(machine, field), rel=1e-6), field
    assert fit.slowdown(2) == pytest.approx(machine.slowdown(2), rel=1e-6)
    others = [with_layout(cfg, dp=d, pp=p, schedule=s, micro_batch=b, recompute=r) for d, p, s, b, r in UNPROBED]
    assert seconds(others, fit) == pytest.approx(seconds(others, machine), rel=1e-6)


def test_four_ranks_share_what_two_measured(cfg: Config) -> None:
    """Ranks beyond the probes' two share the same compute: a CPU's cores are time-shared."""
    fit = fitted(probe_layouts(cfg, max_ranks=2), MACHINE)
    assert fit.slowdown(1) == 1.0 and fit.slowdown(4) == pytest.approx(2 * fit.slowdown(2)) == pytest.approx(2.5)


def test_gpu_ranks_keep_their_devices(cfg: Config) -> None:
    """Two GPU ranks only fit the messages' cost: each rank has its own device, no slowdown."""
    gpu = dataclasses.replace(MACHINE, parallel_devices=None)
    fit = fitted(probe_layouts(cfg, max_ranks=2), gpu, shared_machine=False)
    assert fit.parallel_devices is None and fit.p2p_s == pytest.approx(gpu.p2p_s, rel=1e-6)


def test_one_device_keeps_the_default_pipeline_constants(cfg: Config) -> None:
    fit = fitted(probe_layouts(cfg, max_ranks=1), MACHINE, shared_machine=False)
    assert fit.achieved_flops == pytest.approx(MACHINE.achieved_flops, rel=1e-6)
    assert (fit.p2p_s, fit.parallel_devices) == (Efficiency.p2p_s, None)
