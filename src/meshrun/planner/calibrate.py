"""`meshrun plan --calibrate`: time real training steps here and fit the cost model's constants.

Probes are small layouts of the user's model on random batches of its task (`probe.py`), timed in alternating
rounds (every probe once, then again) and summarised by their median, so that a machine whose
load drifts affects every probe alike. Each probe times plain steps and logged ones (a log step
gathers every rank's figures and, under pp, measures and gathers every rank's pipeline
timeline). The fit has three stages, and a fourth for train.compile:
1. one-rank probes (different micro_batch, microbatch count and recompute), by non-negative least
   squares: step = FLOPs / achieved_flops + actions x action_s + step_s (actions = a forward and a
   backward per microbatch);
2. two-rank probes (dp=2, and pp=2 1F1B at two microbatch counts), with the model of stage 1:
   step = slowdown x (compute + bubble + per-step work) + messages x p2p_s + bandwidth terms.
   On a CPU the slowdown (>= 1) is what each rank loses when two share the cores (other users'
   processes take some), saved as parallel_devices = 2 / slowdown: r ranks then compute
   max(1, r / parallel_devices) times slower than one alone. GPU ranks each have a device: 1.
   p2p_s is each pipeline message's fixed cost.
3. with those: an FSDP collective's fixed cost (`shard_s`) from the FSDP probe, what a logged step
   adds (`log_s` from the one-rank probes; `timeline_share` of the step from the pipeline ones).
4. where the config's train.compile resolves to on here: what compiling does to compute
   (`compiled_compute`), from one more one-rank probe run compiled (its warm-up step compiles)
   against its eager twin. Every other probe runs eager, so the fit above is eager's.
A machine with one GPU runs only stage 1 and the logged steps' cost (p2p_s and shard_s keep their
defaults).
The result is saved as JSON per device.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch

from meshrun.config.schema import Config
from meshrun.errors import ConfigError, RunError
from meshrun.files.atomic import write_atomic
from meshrun.files.console import say
from meshrun.hardware.peaks import find_device
from meshrun.parallel.stages import validate_layout
from meshrun.planner.cost import Efficiency, Hardware
from meshrun.planner.probe import ProbeTimes, probe_seconds
from meshrun.planner.search import compiles, predict, stage_profiles, with_layout

# (micro_batch, recompute, share of the global batch): the half batch tells per-step from per-FLOP costs
ONE_RANK_PROBES = ((1, "none", 1), (2, "none", 1), (4, "none", 1), (1, "full", 1), (4, "full", 1), (2, "none", 2))
# (dp, pp, microbatches per rank, dp_mode), 1F1B, no recompute
TWO_RANK_PROBES = ((2, 1, 2, "ddp"), (1, 2, 2, "ddp"), (1, 2, 8, "ddp"), (2, 1, 2, "fsdp"))


def device_name(device: torch.device) -> str:
    """The name plans use for this device: the GPU table's key when known (so `--gpu h100` finds
    an H100's calibration), else the CUDA name; `cpu` for CPUs."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    spec = find_device(name)
    return spec.key if spec is not None else name


def default_path(device: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "meshrun" / f"calibration-{'-'.join(device.lower().split())}.json"


def probe_layouts(cfg: Config, *, max_ranks: int, compiled: bool = False) -> list[Config]:
    """The probes `cfg`'s model and global batch allow (two-rank ones only where the machine has two
    devices), all eager; `compiled`: and the compiled twin of one (see compiled_probe)."""
    batch, layouts = cfg.train.global_batch, []
    setting = cfg.train.compile
    cfg = _with_compile(cfg, False)
    for micro_batch, recompute, divisor in ONE_RANK_PROBES:
        if batch % (micro_batch * divisor) == 0:
            share = batch // divisor
            layouts.append(
                with_layout(
                    cfg, dp=1, pp=1, schedule="1f1b", micro_batch=micro_batch, recompute=recompute, global_batch=share
                )
            )
    for dp, pp, microbatches, dp_mode in TWO_RANK_PROBES if max_ranks >= 2 else ():
        microbatches = min(microbatches, batch // dp)
        if batch % (dp * microbatches):
            continue
        micro_batch = batch // dp // microbatches
        try:
            layout = with_layout(
                cfg, dp=dp, pp=pp, schedule="1f1b", micro_batch=micro_batch, recompute="none", dp_mode=dp_mode
            )
            validate_layout(layout)
        except ConfigError:  # too few blocks for two stages
            continue
        if all(layout != known for known in layouts):
            layouts.append(layout)
    return [*layouts, compiled_probe(layouts, setting)] if compiled else layouts


def compiled_probe(layouts: list[Config], setting: bool | str) -> Config:
    """The one-rank probe of the whole batch without recompute and the largest micro_batch (the
    most compute beside the per-step floor), with train.compile as the user set it: `auto` runs a
    block that cannot compile eager, as the job will."""
    whole = layouts[0].train.global_batch  # the first probe's: (1, "none", 1) always runs
    eager = [c for c in layouts if c.world_size == 1 and c.recompute == "none" and c.train.global_batch == whole]
    return _with_compile(max(eager, key=lambda c: c.train.micro_batch), setting)


def _with_compile(cfg: Config, setting: bool | str) -> Config:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": setting})})


def _nonnegative_lstsq(a: torch.Tensor, b: torch.Tensor, *, required: int) -> list[float]:
    """Least squares of relative errors (a 30 ms probe counts as much as a 300 ms one) with every
    coefficient >= 0: every subset of columns that keeps column `required` is solved and the best
    fit whose coefficients are all >= 0 wins (few columns)."""
    a, b = a / b, torch.ones_like(b)
    best, best_error = [0.0] * a.shape[1], float("inf")
    for terms in itertools.product((0, 1), repeat=a.shape[1]):
        columns = [i for i, used in enumerate(terms) if used]
        if required not in columns:
            continue
        solution = torch.linalg.lstsq(a[:, columns], b).solution.flatten().tolist()
        if min(solution) < 0:
            continue
        full = [0.0] * a.shape[1]
        for column, value in zip(columns, solution):
            full[column] = value
        error = float(((a @ torch.tensor(full, dtype=torch.float64).unsqueeze(1) - b) ** 2).sum())
        if error < best_error:
            best, best_error = full, error
    return best


COMPILED_RANGE = (0.2, 1.5)  # compiling fuses kernels: a few times faster at most, and slower than eager
# only where its graphs break or recompile; outside, the probe caught a compilation or noise
RECOMPUTE_RANGE = (0.5, 2.0)  # a recomputed forward runs the kernels the first forward ran: its FLOPs cost
# what training FLOPs cost, within the spread of forward vs backward efficiency; outside, the fit is noise


def fit(samples: list[tuple[float, float, int, float]], *, step_floor: float = 0.0) -> tuple[Efficiency, list[str]]:
    """Stage 1: (step model FLOPs, recomputed FLOPs, actions, seconds) of one-rank probes -> seconds
    per FLOP, per recomputed FLOP, per action and per step (compute must cost something; a
    recomputed FLOP costs what another does when no probe recomputes). `step_floor`: the per-step
    seconds measured directly (the optimizer's); the fit adds what else each step costs. Also the
    warnings of `plausible`."""
    a = torch.tensor([[flops, again, actions, 1.0] for flops, again, actions, _ in samples], dtype=torch.float64)
    b = torch.tensor([[seconds - step_floor] for *_, seconds in samples], dtype=torch.float64)
    if (b <= 0).any():  # a probe no slower than its optimizer alone: its compute cost nothing
        raise RunError(
            "calibration fit implausible: a probe took no longer than its optimizer step; run again with more --rounds and --steps"
        )
    per_flop, per_recomputed, action_s, step_s = _nonnegative_lstsq(a, b, required=0)
    recompute_cost = per_recomputed / max(per_flop, 1e-30) if a[:, 1].any() else 1.0
    warnings = []
    low, high = RECOMPUTE_RANGE
    if not low <= recompute_cost <= high:
        clamped = min(max(recompute_cost, low), high)
        warnings.append(
            f"recomputed FLOPs fitted at {recompute_cost:.2f}x another's, outside {low}-{high}x: "
            f"planned at {clamped}x (the probes' times were too noisy to tell; more --rounds helps)"
        )
        recompute_cost = clamped
        folded = torch.stack([a[:, 0] + clamped * a[:, 1], a[:, 2], a[:, 3]], dim=1)
        per_flop, action_s, step_s = _nonnegative_lstsq(folded, b, required=0)
    if per_flop <= 0:
        raise RunError("calibration fit implausible: compute cost nothing; run again with more --rounds and --steps")
    if action_s == 0:
        warnings.append("no fixed cost per forward or backward could be told from FLOPs: planned as 0 ms")
    eff = Efficiency(
        achieved_flops=1.0 / per_flop,
        action_s=action_s,
        step_s=step_floor + step_s,
        recompute_cost=recompute_cost,
        kernel_floor_s=0.0,  # measured: action_s is this machine's launch and Python cost
    )
    return eff, warnings


def fit_parallel(samples: list[tuple[float, int, float]], *, shared_machine: bool) -> tuple[float, float]:
    """Stage 2: (one-rank seconds of a rank's work, messages, seconds less the bandwidth terms) of
    two-rank probes -> (slowdown >= 1, p2p_s >= 0). The slowdown is fitted only where the ranks
    share the machine's compute (a CPU's cores; a GPU rank has its device to itself: 1)."""
    if shared_machine:
        a = torch.tensor([[work, messages] for work, messages, _ in samples], dtype=torch.float64)
        b = torch.tensor([[seconds] for *_, seconds in samples], dtype=torch.float64)
        slowdown, p2p_s = _nonnegative_lstsq(a, b, required=0)
        if slowdown > 1.0:
            return slowdown, p2p_s
    # not slower together (or a device each): the messages' cost is what the pipelines add to the work
    extra = [(seconds - work) / messages for work, messages, seconds in samples if messages]
    return 1.0, max(0.0, statistics.median(extra)) if extra else Efficiency.p2p_s


def fit_constants(
    layouts: list[Config],
    times: ProbeTimes,
    hw: Hardware,
    *,
    precision: str,
    shared_machine: bool,
) -> tuple[Efficiency, list[str]]:
    """Every stage over the probes' median step times, with the floors measured directly: the
    optimizer's seconds per step, one small message's seconds (a fitted p2p_s below it is raised
    to it, with a warning) and a rank's memory before its model."""
    one_rank = [i for i, layout in enumerate(layouts) if layout.world_size == 1 and not compiles(layout, hw)]
    step_floor = statistics.median(times.optimizer_s[i] for i in one_rank)
    samples = [(*_flops(layouts[i], precision), 2 * layouts[i].accumulation_steps, times.seconds[i]) for i in one_rank]
    eff, warnings = fit(samples, step_floor=step_floor)
    eff = dataclasses.replace(eff, compiled_compute=_compiled_compute(layouts, times, hw, eff.step_s, warnings))
    two_rank = [i for i, layout in enumerate(layouts) if layout.world_size == 2]
    if times.runtime_bytes is not None:
        eff = dataclasses.replace(eff, runtime_bytes=_baseline(layouts, times, hw, eff, precision))
    if times.logged_s is not None:
        eff = dataclasses.replace(eff, log_s=_median_or_zero(times.logged_s[i] - times.seconds[i] for i in one_rank))
    if not two_rank:
        return eff, warnings
    sharded = [i for i in two_rank if layouts[i].layout.dp_shard > 1]
    alone = dataclasses.replace(eff, p2p_s=0.0, parallel_devices=None)
    parallel_samples = []
    for i in two_rank:
        if i in sharded:
            continue
        t = predict(layouts[i], hw, alone, precision=precision, margin=0.0).time
        parallel_samples.append((t.compute + t.bubble + t.fixed, t.messages, times.seconds[i] - t.allreduce - t.p2p))
    slowdown, p2p_s = fit_parallel(parallel_samples, shared_machine=shared_machine)
    if times.message_s is not None and p2p_s < times.message_s:
        warnings.append(
            f"a message fitted at {p2p_s * 1e3:.3f} ms, below the {times.message_s * 1e3:.3f} ms one small message "
            "was measured to take: planned at the measured floor"
        )
        p2p_s = times.message_s
    eff = dataclasses.replace(eff, p2p_s=p2p_s, parallel_devices=2.0 / slowdown if slowdown > 1.0 else None)
    return _fit_shard_and_timeline(eff, layouts, times, hw, precision=precision, sharded=sharded), warnings


def _compiled_compute(
    layouts: list[Config], times: ProbeTimes, hw: Hardware, step_s: float, warnings: list[str]
) -> float | None:
    """Stage 4: a compiled step's compute seconds / its eager twin's (None: no compiled probe). The
    per-step seconds (`step_s`: clipping, AdamW, bookkeeping) are left out of both: compile touches
    only the blocks, so the factor then carries to layouts whose compute outweighs that floor more
    or less than the probe's. Outside COMPILED_RANGE it is clamped, with a warning in `warnings`
    (never None with a compiled probe: a plan then says what was measured)."""
    found = [i for i, layout in enumerate(layouts) if layout.world_size == 1 and compiles(layout, hw)]
    if not found:
        return None
    compiled = found[0]
    eager = layouts.index(_with_compile(layouts[compiled], False))
    floor = step_s if times.seconds[eager] > step_s else 0.0  # a floor fitted above the probe is noise: whole steps
    factor = (times.seconds[compiled] - floor) / (times.seconds[eager] - floor)
    low, high = COMPILED_RANGE
    if low <= factor <= high:
        return factor
    clamped = min(max(factor, low), high)
    warnings.append(
        f"compiled compute fitted at {factor:.2f}x eager's ({times.seconds[compiled] * 1e3:.1f} vs "
        f"{times.seconds[eager] * 1e3:.1f} ms per step), outside {low}-{high}x: planned at {clamped}x "
        "(a step recompiled or the times were noisy; more --steps and --rounds help)"
    )
    return clamped


def _fit_shard_and_timeline(
    eff: Efficiency, layouts: list[Config], times: ProbeTimes, hw: Hardware, *, precision: str, sharded: list[int]
) -> Efficiency:
    """Stage 3, with the constants of stages 1 and 2: an FSDP collective's fixed seconds (what the
    FSDP probes take beyond the rest of their step, per collective, not below a message's), and
    what a logged pipeline step adds as a share of the step."""
    unlogged = dataclasses.replace(eff, log_s=0.0, timeline_share=0.0)
    shard_s = []
    for i in sharded:
        t = predict(layouts[i], hw, dataclasses.replace(unlogged, shard_s=0.0), precision=precision, margin=0.0).time
        shard_s.append((times.seconds[i] - t.total) / max(t.shard_collectives, 1))
    if shard_s:
        eff = dataclasses.replace(eff, shard_s=max(eff.p2p_s, statistics.median(shard_s)))
    if times.logged_s is not None:
        piped = [i for i, layout in enumerate(layouts) if layout.parallel.pp > 1]
        share = ((times.logged_s[i] - times.seconds[i] - eff.log_s) / times.seconds[i] for i in piped)
        eff = dataclasses.replace(eff, timeline_share=_median_or_zero(share))
    return eff


def _median_or_zero(values: Iterable[float]) -> float:
    """The median of measured extras, never below 0 (noise can make a difference negative); 0 for none."""
    kept = list(values)
    return max(0.0, statistics.median(kept)) if kept else 0.0


def _baseline(layouts: list[Config], times: ProbeTimes, hw: Hardware, eff: Efficiency, precision: str) -> int:
    """A rank's runtime bytes: its memory before the model, or on a CPU (whose processes' peak
    resident set is what a run reports) that peak over the two-rank probes less the most tensor
    bytes the plan gives any of their ranks, when more: the allocator's slack and a step's
    transient tensors, which a process keeps resident once touched, belong to the runtime."""
    assert times.runtime_bytes is not None
    if times.peak_bytes is None:
        return times.runtime_bytes
    bare = dataclasses.replace(eff, runtime_bytes=0)
    tensors = max(
        rank.total
        for layout in layouts
        if layout.world_size == 2
        for rank in predict(layout, hw, bare, precision=precision, margin=0.0).ranks
    )
    return max(times.runtime_bytes, times.peak_bytes - tensors)


def _flops(layout: Config, precision: str) -> tuple[float, float]:
    """(model FLOPs, recomputed FLOPs) of one step."""
    stages = stage_profiles(layout, precision)
    tokens = layout.tokens_per_step
    return sum(s.model_flops_per_token for s in stages) * tokens, sum(
        s.recompute_flops_per_token for s in stages
    ) * tokens


def calibrate(
    cfg: Config, hw: Hardware, *, precision: str, steps: int, rounds: int, max_ranks: int, shared_machine: bool
) -> tuple[Efficiency, list[dict], list[str]]:
    """Time the probes in alternating rounds on this machine (saying each as it finishes) and fit;
    also returns the probes' rows and the fit's warnings. `shared_machine`: ranks share its compute
    (CPU cores) rather than each having a device. The probes run at `precision` (autocast)."""
    cfg = cfg.model_copy(update={"precision": precision})
    layouts = probe_layouts(cfg, max_ranks=max_ranks, compiled=compiles(cfg, hw))
    per_round: list[ProbeTimes] = []
    for r in range(rounds):
        say(f"calibration round {r + 1}/{rounds}: {len(layouts)} probes")
        per_round.append(probe_seconds(layouts, steps=steps, say=say))
    messages = [t.message_s for t in per_round if t.message_s is not None]
    baselines = [t.runtime_bytes for t in per_round if t.runtime_bytes is not None]
    peaks = [t.peak_bytes for t in per_round if t.peak_bytes is not None]
    times = ProbeTimes(
        seconds=[statistics.median(t.seconds[i] for t in per_round) for i in range(len(layouts))],
        optimizer_s=[statistics.median(t.optimizer_s[i] for t in per_round) for i in range(len(layouts))],
        message_s=statistics.median(messages) if messages else None,
        runtime_bytes=int(statistics.median(baselines)) if baselines else None,
        peak_bytes=max(peaks) if peaks else None,
        logged_s=[statistics.median(t.logged_s[i] for t in per_round if t.logged_s) for i in range(len(layouts))],
    )
    rows = [
        {
            "dp": layout.parallel.dp,
            "dp_mode": layout.parallel.dp_mode,
            "pp": layout.parallel.pp,
            "micro_batch": layout.train.micro_batch,
            "microbatches": layout.accumulation_steps,
            "recompute": layout.recompute,
            "compile": compiles(layout, hw),
            "flops": sum(_flops(layout, precision)),
            "seconds": times.seconds[i],
            "optimizer_s": times.optimizer_s[i],
            "logged_s": times.logged_s[i] if times.logged_s is not None else None,
            "rounds": [t.seconds[i] for t in per_round],
        }
        for i, layout in enumerate(layouts)
    ]
    eff, warnings = fit_constants(layouts, times, hw, precision=precision, shared_machine=shared_machine)
    return eff, rows, warnings


FIELDS = (
    "achieved_flops",
    "action_s",
    "step_s",
    "recompute_cost",
    "p2p_s",
    "parallel_devices",
    "kernel_floor_s",
    "runtime_bytes",
    "shard_s",
    "log_s",
    "timeline_share",
    "compiled_compute",
)


def save_calibration(path: Path, device: str, precision: str, eff: Efficiency, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device, "precision": precision, **{f: getattr(eff, f) for f in FIELDS}, "probes": rows}
    write_atomic(path, json.dumps(record, indent=1))


# What a measurement on any machine could give, per constant (least, most): the cost model divides
# by achieved_flops and parallel_devices (> 0), and a value beyond these plans in inf or NaN.
BOUNDS = {
    "achieved_flops": (1.0, 1e18),  # FLOP/s per device: an exaFLOP/s at most
    "parallel_devices": (1e-3, 1e6),  # full-speed ranks a machine is worth
    "recompute_cost": (0.0, 1e3),
    "compiled_compute": (1e-3, 1e3),
    "timeline_share": (0.0, 1e3),
    "runtime_bytes": (0.0, 2.0**50),  # a petabyte per rank
}
MOST_SECONDS = 1e6  # the *_s constants: fixed seconds per step, action or message (11 days)


def load_calibration(path: Path) -> tuple[str, Efficiency]:
    """(device, constants) saved by `save`; one line naming the file when it is not such a record.
    Files saved before a field existed get its default (compiled_compute: not measured, a compiled
    job planned as eager), except the kernel floor: 0 (measured)."""
    again = "run `meshrun plan --calibrate CONFIG` again"
    try:
        record = json.loads(path.read_text())
        known = {f: record[f] for f in FIELDS if f in record}
        device = record["device"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ConfigError(f"{path} is not a calibration record; {again}") from None
    if not isinstance(device, str):
        raise ConfigError(f"{path} is not a calibration record (device {device!r} is not a name); {again}")
    for field, value in known.items():
        if problem := _constant_problem(field, value):
            raise ConfigError(f"{path} is not a calibration record ({field} {problem}); {again}")
    return device, Efficiency(**{"kernel_floor_s": 0.0, **known})


def _constant_problem(field: str, value: object) -> str | None:
    """Why `value` is no saved constant (a number within BOUNDS; None where "not measured" or "a
    device per rank" is one), or None."""
    if value is None:
        return None if field in ("parallel_devices", "compiled_compute") else "is null"
    shown = repr(value) if len(repr(value)) <= 24 else repr(value)[:21] + "..."
    if not isinstance(value, int | float) or isinstance(value, bool):
        return f"is {shown}, not a number"
    least, most = BOUNDS.get(field, (0.0, MOST_SECONDS))
    if not (math.isfinite(value) if isinstance(value, float) else abs(value) < 2**63) or not least <= value <= most:
        return f"is {shown}, not a measured value from {least:g} to {most:g}"
    return None
