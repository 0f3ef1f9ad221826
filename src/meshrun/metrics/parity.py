"""What `meshrun parity` calls equal: two runs of one job in two layouts, compared step by step
(loss and pre-clip gradient norm, from metrics.jsonl) and tensor by tensor (weights, from their
checkpoints), against tolerances that depend on precision (docs/tools/parity.md: what equal means).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from meshrun.metrics.record import read_metrics_rows


@dataclass(frozen=True)
class Tolerance:
    loss: float  # relative: |a - b| <= loss x max(|a|, |b|)
    grad_norm: float  # relative, as loss
    weights: float | None  # elementwise |a - b| <= w + w x |b| (rtol = atol = w); None: shown, not judged
    measured: str  # where the numbers come from


# fp32: the bound the layout tests hold every layout to against one process (tests/training/
# test_data_parallel.py, tests/parallel/test_pipeline.py). bf16 / fp16: ~10x the largest difference
# measured between equal layouts on a 2-core CPU with AVX512-BF16 (docs/tools/parity.md).
TOLERANCES = {
    "fp32": Tolerance(1e-5, 1e-5, 1e-5, "dp2 x pp2 vs dp1, 4 steps: 4e-8 loss, 9e-8 grad norm, 1.4e-6 weights"),
    "bf16": Tolerance(5e-4, 5e-3, None, "dp2 x pp2 and micro_batch 1/8 vs dp1, 8 steps: 4e-5 loss, 4.5e-4 grad norm"),
    "fp16": Tolerance(5e-5, 5e-4, None, "dp2 x pp2 and micro_batch 1 vs dp1, 8 steps: 3.4e-6 loss, 4.7e-5 grad norm"),
}
_LOOSEST_FIRST = ("bf16", "fp16", "fp32")
_RANKING = 1e-5  # weights in bf16 / fp16 are ranked against fp32's bound (shown, not judged)


def tolerance_for(precisions: tuple[str, str]) -> tuple[str, Tolerance]:
    """The looser of the two runs' (resolved) precisions and its tolerances."""
    name = next(p for p in _LOOSEST_FIRST if p in precisions)
    return name, TOLERANCES[name]


def relative(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude (0 when equal, including two zeros)."""
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))


@dataclass(frozen=True)
class StepDiff:
    step: int
    loss: tuple[float, float]
    grad_norm: tuple[float, float]

    def exceeds(self, tol: Tolerance) -> list[tuple[str, float]]:
        """The quantities beyond tolerance at this step, with their relative differences."""
        found = [("loss", relative(*self.loss), tol.loss), ("grad norm", relative(*self.grad_norm), tol.grad_norm)]
        return [(name, value) for name, value, bound in found if not value <= bound]  # NaN: a difference


def step_diffs(run_a: Path, run_b: Path) -> tuple[list[StepDiff], list[int]]:
    """Each step's loss and grad norm in both runs, and the steps only one of them logged."""
    logged = [{r["step"]: r for r in read_metrics_rows(run / "metrics.jsonl") if "loss" in r} for run in (run_a, run_b)]
    a, b = logged
    both = sorted(a.keys() & b.keys())
    diffs = [
        StepDiff(s, (a[s]["loss"], b[s]["loss"]), (a[s]["grad_norm"], b[s]["grad_norm"]))
        for s in both
        if "grad_norm" in a[s] and "grad_norm" in b[s]
    ]
    return diffs, sorted(a.keys() ^ b.keys())


@dataclass(frozen=True)
class TensorDiff:
    name: str
    max_abs: float  # the largest elementwise |a - b|
    ratio: float  # the largest |a - b| / (w + w x |b|): above 1 is beyond tolerance w


def weight_diffs(ckpt_a: Path, ckpt_b: Path, tol: Tolerance) -> tuple[list[TensorDiff], list[str]]:
    """Every weight both checkpoints hold, largest ratio to tolerance first, and the names held by
    one only or with another shape. Read a group of tensors at a time (any model size)."""
    from meshrun.checkpoint.dcp import saved_weights, weight_groups

    saved_a, saved_b = saved_weights(ckpt_a), saved_weights(ckpt_b)
    common = sorted(n for n in saved_a.keys() & saved_b.keys() if saved_a[n] == saved_b[n])
    unmatched = sorted((saved_a.keys() | saved_b.keys()) - set(common))
    w = tol.weights or _RANKING
    diffs = []
    for group_a, group_b in zip(weight_groups(ckpt_a, common), weight_groups(ckpt_b, common)):
        for name, a in group_a.items():
            a, b = a.double(), group_b[name].double()
            delta = (a - b).abs()
            ratio = (delta / (w + w * b.abs())).max().item() if delta.numel() else 0.0
            diffs.append(TensorDiff(name, delta.max().item() if delta.numel() else 0.0, ratio))
    diffs.sort(key=lambda d: (float("-inf") if math.isnan(d.ratio) else -d.ratio, d.name))  # NaN first
    return diffs, unmatched


@dataclass(frozen=True)
class WeightsAt:
    step: int
    diffs: list[TensorDiff]
    unmatched: list[str]

    def differ(self, tol: Tolerance) -> bool:
        judged = tol.weights is not None and any(not d.ratio <= 1 for d in self.diffs)
        return judged or bool(self.unmatched)


def weights_at(checkpoints: Iterable[tuple[int, Path, Path]], tol: Tolerance) -> list[WeightsAt]:
    """Weights compared after each (step, checkpoint of A, checkpoint of B) given, in step order,
    up to the first step whose weights differ (what comes after it follows from it)."""
    found = []
    for step, a, b in checkpoints:
        found.append(WeightsAt(step, *weight_diffs(a, b, tol)))
        if found[-1].differ(tol):
            break
    return found


def _steps_table(steps: list[StepDiff], tol: Tolerance) -> list[str]:
    head = f"{'step':>5} {'loss A':>13} {'loss B':>13} {'rel diff':>9} {'grad norm A':>13} {'grad norm B':>13} {'rel diff':>9}"
    lines = [head, "-" * len(head)]
    for d in steps:
        beyond = d.exceeds(tol)
        lines.append(
            f"{d.step:>5} {d.loss[0]:>13.8g} {d.loss[1]:>13.8g} {relative(*d.loss):>9.2g} "
            f"{d.grad_norm[0]:>13.8g} {d.grad_norm[1]:>13.8g} {relative(*d.grad_norm):>9.2g}  "
            + (" and ".join(name for name, _ in beyond).upper() + " DIFFER" if beyond else "ok")
        )
    return lines


def _weights_table(at: WeightsAt, tol: Tolerance, top: int) -> list[str]:
    judged = "" if tol.weights is not None else " (shown, not judged: see docs/tools/parity.md)"
    lines = [f"weights after step {at.step}: {len(at.diffs)} tensors, largest difference first{judged}"]
    head = f"{'tensor':<44} {'max |a-b|':>10} {f'x {tol.weights or _RANKING:g}':>12}"
    lines += [head, "-" * len(head)]
    for d in at.diffs[:top]:
        mark = "DIFFERS" if tol.weights is not None and not d.ratio <= 1 else ""
        lines.append(f"{d.name:<44} {d.max_abs:>10.2g} {d.ratio:>12.3g}  {mark}".rstrip())
    lines += [f"{name:<44} {'only in one run, or another shape':>23}  DIFFERS" for name in at.unmatched]
    return lines


def report(
    precision: str,
    tol: Tolerance,
    steps: list[StepDiff],
    missing: list[int],
    weights: list[WeightsAt],
    *,
    every_step: bool,
    top: int = 8,
) -> tuple[str, bool]:
    """The tables and the verdict line; True when the runs are equal within `tol`. `weights`: the
    final weights' comparison, or (`every_step`) each step's up to the first that differs."""
    w = f"weights |a-b| <= {tol.weights:g} + {tol.weights:g} x |b|" if tol.weights else "weights not judged"
    lines = [f"tolerance ({precision}): loss {tol.loss:g}, grad norm {tol.grad_norm:g} relative; {w}"]
    lines += [f"  (measured between equal layouts: {tol.measured})", ""]
    lines += _steps_table(steps, tol)
    lines += [f"step {s}: logged by one run only" for s in missing]
    shown = next((at for at in weights if at.differ(tol)), weights[-1] if weights else None)
    if shown is not None:
        lines += ["", *_weights_table(shown, tol, top)]
    first = next((d for d in steps if d.exceeds(tol)), None)
    equal = first is None and not missing and not (shown and shown.differ(tol))
    if equal:
        judged = f", {len(shown.diffs)} weight tensors" if shown and tol.weights else ""
        lines += ["", f"verdict: EQUAL within the {precision} tolerances ({len(steps)} steps{judged})"]
        return "\n".join(lines), True
    found = []
    if first is not None:
        beyond = ", ".join(f"{name} {value:.2g} relative" for name, value in first.exceeds(tol))
        found.append(f"first at step {first.step} ({beyond})")
    elif missing:
        found.append(f"step {missing[0]} logged by one run only")
    if shown is not None and shown.diffs:
        worst = shown.unmatched[0] if shown.unmatched else shown.diffs[0].name
        which = "the first step whose weights differ" if every_step and shown.differ(tol) else "the final weights"
        found.append(f"after step {shown.step} ({which}) the tensor that differs most is {worst}")
    lines += ["", "verdict: DIFFERENT: " + "; ".join(found)]
    return "\n".join(lines), False
