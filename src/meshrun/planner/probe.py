"""Timed probes of `meshrun plan --calibrate`: real training steps of small layouts on random tokens.

One-rank layouts run in this process; the layouts of two ranks run together in one torchrun job of
this module (`python -m torch.distributed.run --standalone -m meshrun.planner.probe CONFIGS OUT
STEPS`: one process group, a mesh per layout), so a probe pays what training pays: meshrun's
`parallelize`, the pipeline schedule's messages, DDP's all-reduce, the tied embeddings' gradient
sum and fused AdamW, with the ranks competing for the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.config.schema import Config
from meshrun.errors import RunError
from meshrun.launcher.torchrun import WORKER_ENV
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import Mesh, init_mesh, mesh_on, shutdown


def time_steps(cfg: Config, mesh: Mesh, *, steps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `steps` training steps after `warmup` (forward, backward, optimizer); with
    several ranks each step starts and ends at a barrier, so the time is the slowest rank's."""
    from meshrun.parallel.parallelize import parallelize
    from meshrun.training.loss import MicrobatchLoss
    from meshrun.training.optim import build_optimizer

    model = parallelize(cfg, mesh, loss=MicrobatchLoss(cfg.accumulation_steps), amp=contextlib.nullcontext)
    optimizers = [build_optimizer(part, cfg.train) for part in model.parts]
    tokens = torch.randint(
        0,
        cfg.model.vocab_size,
        (cfg.train.global_batch // mesh.dp, cfg.model.seq_len + 1),
        generator=torch.Generator().manual_seed(0),
    ).to(mesh.device)
    times = []
    for step in range(warmup + steps):
        _sync(mesh.device)
        start = time.perf_counter()
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        model.tied.sync_gradients()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(mesh.device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.get_world_size() > 1:
        dist.barrier()


def probe_seconds(layouts: list[Config], *, steps: int, timeout: float = 900) -> list[float]:
    """Median step time of each layout on this machine (all of two ranks in one torchrun job)."""
    medians: dict[int, float] = {}
    for index, layout in enumerate(layouts):
        if layout.world_size == 1:
            mesh = init_mesh(Layout())
            try:
                medians[index] = statistics.median(time_steps(layout, mesh, steps=steps))
            finally:
                shutdown()
    together = [index for index, layout in enumerate(layouts) if layout.world_size > 1]
    if together:
        times = _torchrun([layouts[i] for i in together], steps=steps, timeout=timeout)
        medians.update(zip(together, map(statistics.median, times)))
    return [medians[index] for index in range(len(layouts))]


def _torchrun(layouts: list[Config], *, steps: int, timeout: float) -> list[list[float]]:
    world = layouts[0].world_size
    assert all(layout.world_size == world for layout in layouts)  # one job, one process group
    with tempfile.TemporaryDirectory(prefix="meshrun-probe-") as tmp:
        configs, out = Path(tmp) / "configs.json", Path(tmp) / "times.json"
        configs.write_text(json.dumps([layout.model_dump(mode="json") for layout in layouts]))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        argv += ["-m", "meshrun.planner.probe", str(configs), str(out), str(steps)]
        env = {**os.environ, **WORKER_ENV, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RunError(f"calibration probes of {world} ranks failed:\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def probe_worker(argv: list[str]) -> None:
    """torchrun worker: time every layout in CONFIGS on one process group; rank 0 writes the times to OUT."""
    configs, out, steps = argv
    layouts = [Config.model_validate(data) for data in json.loads(Path(configs).read_text())]
    mesh = init_mesh(layouts[0].layout)
    try:
        times = []
        for layout in layouts:
            if layout.layout != mesh.layout:  # the same processes in another shape
                mesh = mesh_on(layout.layout, mesh.device)
            times.append(time_steps(layout, mesh, steps=int(steps)))
    finally:
        shutdown()
    if os.environ.get("RANK") == "0":
        Path(out).write_text(json.dumps(times))


if __name__ == "__main__":
    probe_worker(sys.argv[1:])
