"""`meshrun plan --calibrate`: time real training steps here and fit the cost model's constants.

Each probe is a one-process layout (different micro_batch, microbatch count and recompute) run
through meshrun's own `parallelize` and fused AdamW on random tokens; the step time of
a few steps after a warm-up (the fastest) is fitted by least squares as
    step = FLOPs / achieved_flops + actions x action_s + step_s
(actions = a forward and a backward per microbatch). The result is saved as JSON per device.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from pathlib import Path

import torch

from meshrun.config import Config
from meshrun.metrics.devices import find_device
from meshrun.planner.cost import Efficiency
from meshrun.planner.search import stage_profiles, with_layout

PROBES = ((1, "none"), (2, "none"), (4, "none"), (1, "full"), (4, "full"))  # (micro_batch, recompute)


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


def time_steps(cfg: Config, *, steps: int, warmup: int = 1) -> float:
    """Fastest of `steps` timed training steps (forward, backward, optimizer) of a one-process layout:
    other processes on a shared machine only ever add time, so the minimum is the least noisy."""
    from meshrun.distributed import init_mesh, shutdown
    from meshrun.parallel import parallelize
    from meshrun.training.loss import MicrobatchLoss
    from meshrun.training.optim import build_optimizer

    mesh = init_mesh(dp=1, pp=1)
    try:
        model = parallelize(cfg, mesh, loss=MicrobatchLoss(cfg.accumulation_steps), amp=contextlib.nullcontext)
        optimizers = [build_optimizer(part, cfg.train) for part in model.parts]
        tokens = torch.randint(
            0,
            cfg.model.vocab_size,
            (cfg.train.global_batch, cfg.model.seq_len + 1),
            generator=torch.Generator().manual_seed(0),
        ).to(mesh.device)
        times = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            model.forward_backward(tokens[:, :-1], tokens[:, 1:])
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if mesh.device.type == "cuda":
                torch.cuda.synchronize(mesh.device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
        return min(times)
    finally:
        shutdown()


def fit(samples: list[tuple[float, int, float]]) -> Efficiency:
    """Non-negative least squares of (step FLOPs, actions, seconds) samples -> seconds per FLOP,
    per action and per step: every subset of the three terms is solved and the best fit whose
    constants are all >= 0 wins (three unknowns: eight small solves)."""
    a = torch.tensor([[flops, actions, 1.0] for flops, actions, _ in samples], dtype=torch.float64)
    b = torch.tensor([[seconds] for *_, seconds in samples], dtype=torch.float64)
    best, best_error = (0.0, 0.0, 0.0), float("inf")
    for terms in itertools.product((0, 1), repeat=3):
        columns = [i for i, used in enumerate(terms) if used]
        if 0 not in columns:  # compute must cost something
            continue
        solution = torch.linalg.lstsq(a[:, columns], b).solution.flatten().tolist()
        if min(solution) < 0:
            continue
        full = [0.0, 0.0, 0.0]
        for column, value in zip(columns, solution):
            full[column] = value
        error = float(((a @ torch.tensor(full, dtype=torch.float64).unsqueeze(1) - b) ** 2).sum())
        if error < best_error:
            best, best_error = tuple(full), error
    per_flop, action_s, step_s = best
    return Efficiency(achieved_flops=1.0 / max(per_flop, 1e-30), action_s=action_s, step_s=step_s)


def calibrate(cfg: Config, *, precision: str, steps: int = 3) -> tuple[Efficiency, list[dict]]:
    """Time the probes on this machine's first device and fit; also returns the probes' rows."""
    samples, rows = [], []
    batch = cfg.train.global_batch
    for micro_batch, recompute in PROBES:
        if batch % micro_batch:
            continue
        probe = with_layout(cfg, dp=1, pp=1, schedule="1f1b", micro_batch=micro_batch, recompute=recompute)
        flops = sum(s.flops_per_token for s in stage_profiles(probe, precision)) * probe.tokens_per_step
        actions = 2 * probe.accumulation_steps
        seconds = time_steps(probe, steps=steps)
        samples.append((flops, actions, seconds))
        rows.append(
            {"micro_batch": micro_batch, "recompute": recompute, "flops": flops, "actions": actions, "seconds": seconds}
        )
    return fit(samples), rows


def save(path: Path, device: str, precision: str, eff: Efficiency, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "device": device,
        "precision": precision,
        "achieved_flops": eff.achieved_flops,
        "action_s": eff.action_s,
        "step_s": eff.step_s,
        "probes": rows,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def load(path: Path) -> tuple[str, Efficiency]:
    """(device, constants) saved by `save`."""
    record = json.loads(path.read_text())
    return record["device"], Efficiency(
        achieved_flops=record["achieved_flops"], action_s=record["action_s"], step_s=record["step_s"]
    )
