"""`meshrun plan --calibrate`'s fit, without timing anything: step times that a known set of
constants predicts for the probes are fitted back, and the fitted constants must give those
constants and the same predictions for layouts no probe ran (interleaved, GPipe, dp=2 with more
microbatches, recompute in a pipeline). Deterministic: profiles are traced under fake tensors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from meshrun.config.schema import Config, load_config
from meshrun.errors import RunError
from meshrun.planner.calibrate import (
    COMPILED_RANGE,
    RECOMPUTE_RANGE,
    _compiled_compute,
    fit,
    fit_constants,
    load_calibration,
    probe_layouts,
    save_calibration,
)
from meshrun.planner.cost import Efficiency, Hardware
from meshrun.planner.probe import ProbeTimes
from meshrun.planner.search import predict, with_layout

CPU = Hardware("cpu", float("inf"), None, intra_gbs=10.0, inter_gbs=1.25, gpus_per_node=2)
MACHINE = Efficiency(
    achieved_flops=3e9,
    action_s=2e-3,
    recompute_cost=1.7,
    step_s=5e-3,
    p2p_s=4e-4,
    parallel_devices=1.6,
    kernel_floor_s=0.0,
    runtime_bytes=400 * 2**20,
    shard_s=1.5e-3,
    log_s=1e-3,
    timeline_share=0.4,
)
OPTIMIZER_S = 3e-3  # the part of step_s measured directly (the optimizer's seconds)
UNPROBED = [  # (dp, pp, schedule, micro_batch, recompute, dp_mode)
    (1, 2, "interleaved-1f1b", 1, "none", "ddp"),
    (1, 2, "gpipe", 2, "none", "ddp"),
    (2, 1, "1f1b", 1, "none", "ddp"),
    (1, 2, "1f1b", 2, "full", "ddp"),
    (1, 1, "1f1b", 8, "every:2", "ddp"),
    (2, 1, "1f1b", 1, "none", "fsdp"),
]


@pytest.fixture(scope="module")
def cfg() -> Config:
    settings = ["model.num_layers=4", "model.dim=32", "model.num_heads=2", "model.seq_len=16"]
    return load_config(None, [*settings, "train.global_batch=8", "precision=fp32"])


def fitted(
    layouts: list[Config], eff: Efficiency, *, shared_machine: bool = True, message_s: float | None = 1e-4
) -> Efficiency:
    """The fit of the step times `eff` predicts for `layouts` (no warnings: nothing implausible)."""
    fit, warnings = fit_constants(
        layouts, probe_times(layouts, eff, message_s), CPU, precision="fp32", shared_machine=shared_machine
    )
    assert warnings == []
    return fit


def probe_times(layouts: list[Config], eff: Efficiency, message_s: float | None) -> ProbeTimes:
    """What the probes would time on a machine of `eff`: steps not logged, and logged ones."""
    two_ranks = any(layout.world_size == 2 for layout in layouts)
    plain = seconds(layouts, dataclasses.replace(eff, log_s=0.0, timeline_share=0.0))
    logged = [
        t + eff.log_s + (eff.timeline_share * t if layout.parallel.pp > 1 else 0.0) for t, layout in zip(plain, layouts)
    ]
    return ProbeTimes(
        seconds=plain,
        optimizer_s=[OPTIMIZER_S] * len(layouts),
        message_s=message_s if two_ranks else None,
        runtime_bytes=eff.runtime_bytes if two_ranks else None,
        logged_s=logged,
    )


def seconds(layouts: list[Config], eff: Efficiency) -> list[float]:
    return [predict(layout, CPU, eff, precision="fp32", margin=0.0).time.total for layout in layouts]


def test_probes_cover_one_and_two_ranks(cfg: Config) -> None:
    shapes = {
        (c.parallel.dp, c.parallel.pp, c.accumulation_steps, c.recompute) for c in probe_layouts(cfg, max_ranks=2)
    }
    assert {(2, 1, 2, "none"), (1, 2, 2, "none"), (1, 2, 8, "none"), (1, 1, 8, "full")} <= shapes
    assert any(c.layout.dp_shard == 2 for c in probe_layouts(cfg, max_ranks=2))  # an FSDP probe
    assert all(c.world_size == 1 for c in probe_layouts(cfg, max_ranks=1))


@pytest.mark.parametrize("parallel_devices", [1.6, None], ids=["slower-together", "full-speed-together"])
def test_fit_recovers_the_constants_and_their_predictions(cfg: Config, parallel_devices: float | None) -> None:
    machine = dataclasses.replace(MACHINE, parallel_devices=parallel_devices)
    fit = fitted(probe_layouts(cfg, max_ranks=2), machine)
    fields = ("achieved_flops", "action_s", "recompute_cost", "step_s", "p2p_s", "runtime_bytes", "shard_s", "log_s")
    for field in (*fields, "timeline_share"):
        assert getattr(fit, field) == pytest.approx(getattr(machine, field), rel=1e-6), field
    assert fit.slowdown(2) == pytest.approx(machine.slowdown(2), rel=1e-6)
    others = [
        with_layout(cfg, dp=d, pp=p, schedule=s, micro_batch=b, recompute=r, dp_mode=mode)
        for d, p, s, b, r, mode in UNPROBED
    ]
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


def test_an_implausible_recompute_factor_is_clamped_with_a_warning(cfg: Config) -> None:
    """Times where recomputed FLOPs cost 7x another's (the noise issue 29 saw) are fitted at the
    range's edge, said so, and the other constants refitted around it."""
    layouts = probe_layouts(cfg, max_ranks=1)
    noisy = dataclasses.replace(MACHINE, recompute_cost=7.0)
    fit, warnings = fit_constants(
        layouts, probe_times(layouts, noisy, None), CPU, precision="fp32", shared_machine=False
    )
    assert fit.recompute_cost == RECOMPUTE_RANGE[1]
    assert len(warnings) == 1 and "7.00x" in warnings[0] and "outside" in warnings[0]
    assert fit.achieved_flops > 0 and fit.step_s >= OPTIMIZER_S


def test_floors_are_never_below_what_was_measured(cfg: Config) -> None:
    """Step times that a machine without fixed costs gives: the per-step floor is the optimizer's
    measured seconds, the per-message one the measured small message (with a warning), not 0."""
    layouts = probe_layouts(cfg, max_ranks=2)
    free = dataclasses.replace(MACHINE, step_s=OPTIMIZER_S, p2p_s=0.0, action_s=0.0)
    fit, warnings = fit_constants(layouts, probe_times(layouts, free, 2e-4), CPU, precision="fp32", shared_machine=True)
    assert fit.step_s == pytest.approx(OPTIMIZER_S, rel=1e-6) and fit.p2p_s == 2e-4
    assert any("below the 0.200 ms one small message" in w for w in warnings)
    assert any("fixed cost per forward" in w for w in warnings)


def test_a_fit_where_compute_costs_nothing_is_refused() -> None:
    with pytest.raises(RunError, match="implausible"):
        fit([(1e9, 0.0, 2, 0.01), (2e9, 0.0, 2, 0.01)], step_floor=0.02)
    with pytest.raises(RunError, match="no longer than its optimizer"):  # was a division by zero in lstsq
        fit([(1e9, 0.0, 2, 0.02), (2e9, 0.0, 2, 0.03)], step_floor=0.02)


def test_the_runtime_baseline_takes_in_what_a_cpu_step_keeps_resident(cfg: Config) -> None:
    """On a CPU the baseline is the probes' peak resident set less the most tensor bytes planned
    for any of their ranks (allocator slack and a step's transients stay resident), never less
    than the memory measured before the model."""
    layouts = probe_layouts(cfg, max_ranks=2)
    bare = dataclasses.replace(MACHINE, runtime_bytes=0)
    tensors = max(
        r.total for c in layouts if c.world_size == 2 for r in predict(c, CPU, bare, precision="fp32", margin=0.0).ranks
    )
    for peak, baseline in (
        (MACHINE.runtime_bytes + tensors + 5_000_000, MACHINE.runtime_bytes + 5_000_000),
        (MACHINE.runtime_bytes, MACHINE.runtime_bytes),
    ):
        times = dataclasses.replace(probe_times(layouts, MACHINE, 1e-4), peak_bytes=peak)
        fit, _ = fit_constants(layouts, times, CPU, precision="fp32", shared_machine=True)
        assert fit.runtime_bytes == baseline


@pytest.fixture(scope="module")
def compiled_cfg(cfg: Config) -> Config:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": True})})


def test_probes_run_eager_but_the_one_compiled_twin(compiled_cfg: Config) -> None:
    """The fit's probes are eager whatever the config says; the compiled probe is the whole-batch
    one-rank layout without recompute at the largest micro_batch, as the user set train.compile."""
    layouts = probe_layouts(compiled_cfg, max_ranks=2, compiled=True)
    *eager, twin = layouts
    assert all(c.train.compile is False for c in eager) and twin.train.compile is True
    assert (twin.world_size, twin.recompute, twin.train.micro_batch, twin.train.global_batch) == (1, "none", 4, 8)
    assert twin.model_copy(update={"train": twin.train.model_copy(update={"compile": False})}) in eager
    assert all(c.train.compile is False for c in probe_layouts(compiled_cfg, max_ranks=2))


def test_the_compiled_factor_is_fitted_back_and_applied_to_unprobed_layouts(compiled_cfg: Config) -> None:
    """Probe times of a machine where compiled blocks compute 0.6x as long: the factor comes back,
    the eager constants are unchanged, and a compiled layout no probe ran is predicted as that
    machine predicts it (its compute and bubble scaled, the optimizer's floor not)."""
    machine = dataclasses.replace(MACHINE, compiled_compute=0.6)
    fit = fitted(probe_layouts(compiled_cfg, max_ranks=2, compiled=True), machine)
    assert fit.compiled_compute == pytest.approx(0.6, rel=1e-6)
    assert fit.achieved_flops == pytest.approx(MACHINE.achieved_flops, rel=1e-6)
    assert fit.recompute_cost == pytest.approx(MACHINE.recompute_cost, rel=1e-6)
    assert fitted(probe_layouts(compiled_cfg, max_ranks=2), machine).compiled_compute is None  # not measured
    piped = with_layout(compiled_cfg, dp=1, pp=2, schedule="gpipe", micro_batch=1, recompute="full")
    eager = piped.model_copy(update={"train": piped.train.model_copy(update={"compile": False})})
    compiled_time, eager_time = (predict(c, CPU, fit, precision="fp32", margin=0.0).time for c in (piped, eager))
    assert compiled_time.total == pytest.approx(seconds([piped], machine)[0], rel=1e-6)
    assert compiled_time.compute == pytest.approx(0.6 * eager_time.compute, rel=1e-9)
    assert compiled_time.bubble == pytest.approx(0.6 * eager_time.bubble, rel=1e-9) and eager_time.bubble > 0
    assert compiled_time.fixed == eager_time.fixed


def test_an_implausible_compiled_factor_is_clamped_with_a_warning(compiled_cfg: Config) -> None:
    layouts = probe_layouts(compiled_cfg, max_ranks=1, compiled=True)
    slow = dataclasses.replace(MACHINE, compiled_compute=4.0)  # a step that recompiled every time
    fit, warnings = fit_constants(
        layouts, probe_times(layouts, slow, None), CPU, precision="fp32", shared_machine=False
    )
    assert fit.compiled_compute == COMPILED_RANGE[1]
    assert len(warnings) == 1 and "compiled compute fitted at 4.00x" in warnings[0] and "outside" in warnings[0]


def test_a_calibration_saved_before_compile_was_measured_plans_compiled_jobs_as_eager(
    tmp_path: Path, compiled_cfg: Config
) -> None:
    path = tmp_path / "cal.json"
    save_calibration(path, "cpu", "fp32", dataclasses.replace(MACHINE, compiled_compute=0.6), [])
    assert load_calibration(path)[1].compiled_compute == 0.6
    record = json.loads(path.read_text())
    del record["compiled_compute"]
    path.write_text(json.dumps(record))
    old = load_calibration(path)[1]
    assert old.compiled_compute is None and old.compute_factor(True) == 1.0
    eager = compiled_cfg.model_copy(update={"train": compiled_cfg.train.model_copy(update={"compile": False})})
    assert seconds([compiled_cfg], old) == seconds([eager], old)


def test_a_step_floor_fitted_above_the_eager_probe_compares_whole_steps(compiled_cfg: Config) -> None:
    """Noise that fits the per-step floor above the eager twin's whole step: the factor is then
    the ratio of whole steps (a number, never a division by a negative compute), clamped."""
    layouts = probe_layouts(compiled_cfg, max_ranks=1, compiled=True)
    times = probe_times(layouts, dataclasses.replace(MACHINE, compiled_compute=0.6), None)
    twin = layouts.index(
        layouts[-1].model_copy(update={"train": layouts[-1].train.model_copy(update={"compile": False})})
    )
    warnings: list[str] = []
    factor = _compiled_compute(layouts, times, CPU, times.seconds[twin] * 2, warnings)
    assert factor == pytest.approx(times.seconds[-1] / times.seconds[twin]) and warnings == []
    slow = [*times.seconds[:-1], 2 * times.seconds[twin]]  # the compiled step twice the eager one
    factor = _compiled_compute(layouts, dataclasses.replace(times, seconds=slow), CPU, 1.0, warnings)
    assert factor == COMPILED_RANGE[1] and len(warnings) == 1 and "2.00x" in warnings[0]
