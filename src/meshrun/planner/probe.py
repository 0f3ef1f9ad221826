"""Timed probes of `meshrun plan --calibrate`: real training steps of small layouts on random batches
(of the task's shapes: token ids, labelled texts or a series' values).

One-rank layouts run in this process; the layouts of two ranks run together in one torchrun job of
this module (`python -m torch.distributed.run --standalone -m meshrun.planner.probe CONFIGS OUT
STEPS`: one process group, a mesh per layout), so a probe pays what training pays: meshrun's
`parallelize`, the pipeline schedule's messages, DDP's all-reduce, the tied embeddings' gradient
sum and fused AdamW, with the ranks competing for the machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.config.schema import Config
from meshrun.errors import RunError
from meshrun.hardware.device import peak_rss_bytes
from meshrun.hardware.precision import autocast
from meshrun.launcher.lifetime import end_worker
from meshrun.launcher.torchrun import WORKER_ENV
from meshrun.models.task_io import task_io
from meshrun.parallel import timeline
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import Mesh, init_mesh, mesh_on, shutdown
from meshrun.tasks import task_for


@dataclass(frozen=True)
class StepTimes:
    """One probe's timed steps (seconds each)."""

    seconds: list[float]  # a whole step: forward, backward, clipping and AdamW
    optimizer_s: list[float]  # of which the update: clipping, AdamW, zero_grad (the per-step floor)
    logged_s: list[float]  # a step as training logs it: the ranks' figures gathered, under pp its timeline


def time_steps(cfg: Config, mesh: Mesh, *, steps: int, warmup: int = 1, logged: int = 2) -> StepTimes:
    """`steps` training steps after `warmup`, then `logged` more as a log step runs them, under the
    layout's precision (resolved: autocast as training runs it; fp16's loss scaling left out). The
    step is the trainer's: forward and backward, the tied gradients' sum, the global-norm clip,
    AdamW (optim.py's functions) and the stop-request poll's all-reduce. With several ranks each step starts and ends at a barrier, so the
    time is the slowest rank's."""
    from meshrun.parallel.parallelize import parallelize
    from meshrun.training.loss import MicrobatchLoss
    from meshrun.training.optim import Optimizers, clip_global_norm

    summed = task_for(cfg.task).summed(cfg)
    loss = MicrobatchLoss(cfg.accumulation_steps, summed=summed)
    model = parallelize(cfg, mesh, loss=loss, amp=partial(autocast, cfg, mesh.device))
    optimizers = Optimizers(model.parts, cfg.train)
    params = [p for part in model.parts for p in part.parameters()]
    counted = model.experts.dense(model.tied.counted_once(params))
    pp_group = mesh.group("pp") if mesh.size("pp") > 1 else None
    # a random batch of the task's shapes (token ids, labels, a series' values: task_io.py)
    inputs, targets = (
        t.to(mesh.device)
        for t in task_io(cfg).batch(cfg.train.global_batch // mesh.size("dp"), torch.Generator().manual_seed(0))
    )
    keep = torch.zeros((), device=mesh.device)

    def step() -> float:
        model.forward_backward(inputs, targets)
        model.tied.sync_gradients()
        model.experts.sync_gradients()
        _sync(mesh.device)
        update = time.perf_counter()
        clip_global_norm(
            params, counted, max_norm=cfg.train.grad_clip, pp_group=pp_group, split_squared=model.experts.squared_norm()
        )
        optimizers.step_unless(keep)
        optimizers.zero_grad()
        if dist.get_world_size() > 1:  # the trainer's stop-request poll: every rank's flags, each step
            dist.all_reduce(torch.zeros(2, dtype=torch.int32), op=dist.ReduceOp.MAX)
        _sync(mesh.device)
        return update

    times, updates, logs = [], [], []
    for index in range(warmup + steps + logged):
        _sync(mesh.device)
        start = time.perf_counter()
        if index < warmup + steps:
            update = step()
            if index >= warmup:
                times.append(time.perf_counter() - start)
                updates.append(time.perf_counter() - update)
            continue
        with timeline.measuring(mesh.device) if mesh.size("pp") > 1 else contextlib.nullcontext():
            step()
        _log_collectives(mesh)
        _sync(mesh.device)
        logs.append(time.perf_counter() - start)
    return StepTimes(times, updates, logs)


def _log_collectives(mesh: Mesh) -> None:
    """What a log step adds to a step (trainer._log_window): every rank's figures gathered and read
    on the host, and under pp every rank's measured timeline."""
    figures = torch.zeros(8, dtype=torch.float64, device=mesh.device)
    gathered = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, figures)
    _ = [g[0].item() for g in gathered]
    if mesh.size("pp") > 1:
        timeline.gather_timelines(mesh.layout)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.get_world_size() > 1:
        dist.barrier()


def message_seconds(device: torch.device, *, rounds: int = 50) -> float:
    """One small message's seconds between ranks 0 and 1 (half a send/receive round trip): the
    per-message floor."""
    rank, tensor = dist.get_rank(), torch.zeros(1, device=device)
    _sync(device)
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
    return (time.perf_counter() - start) / rounds / 2


def runtime_bytes(cfg: Config, device: torch.device) -> int:
    """What a training worker holds before its model's tensors: its resident memory on a CPU
    (Python, torch, the process group and the code a `meshrun train` worker imports: trainer,
    data, metrics, checkpointing, pipelining, FSDP and the model's family, e.g. transformers),
    the CUDA context and libraries on a GPU (in use less torch's reserved)."""
    from meshrun.models.families import build_model

    for module in ("meshrun.training.worker", "meshrun.parallel.fsdp", "meshrun.parallel.pipeline"):
        importlib.import_module(module)  # what a worker imports: resident like its tensors

    build_model(cfg.model)  # on meta: imports the family's code (transformers for a Hugging Face model)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free - torch.cuda.memory_reserved(device)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProbeTimes:
    seconds: list[float]  # median step seconds, per layout
    optimizer_s: list[float]  # median optimizer seconds, per layout
    message_s: float | None  # one small message (two-rank probes only)
    runtime_bytes: int | None  # a rank's memory before its model (two-rank probes only)
    peak_bytes: int | None = None  # rank 0's peak resident memory over its probes (CPU, two-rank probes only)
    logged_s: list[float] | None = None  # median seconds of a logged step, per layout


def probe_seconds(
    layouts: list[Config], *, steps: int, timeout: float = 900, say: Callable[[str], None] = lambda _: None
) -> ProbeTimes:
    """Median step times of each layout on this machine (all of two ranks in one torchrun job)."""
    medians: dict[int, tuple[float, float, float]] = {}

    def keep(index: int, times: StepTimes) -> None:
        seconds, optimizer_s, logged_s = (
            statistics.median(t) for t in (times.seconds, times.optimizer_s, times.logged_s)
        )
        medians[index] = (seconds, optimizer_s, logged_s)
        say(f"probe {index + 1}/{len(layouts)}: {describe(layouts[index])}: {medians[index][0] * 1e3:.1f} ms/step")

    for index, layout in enumerate(layouts):
        if layout.world_size == 1:
            mesh = init_mesh(Layout())
            try:
                keep(index, time_steps(layout, mesh, steps=steps))
            finally:
                shutdown()
    together = [index for index, layout in enumerate(layouts) if layout.world_size > 1]
    message_s = baseline = peak = None
    if together:
        say(f"probes {', '.join(str(i + 1) for i in together)}/{len(layouts)}: two ranks under torchrun")
        result = _torchrun([layouts[i] for i in together], steps=steps, timeout=timeout)
        for index, times in zip(together, result["times"]):
            keep(index, StepTimes(**times))
        message_s, baseline, peak = result["message_s"], result["runtime_bytes"], result["peak_bytes"]
    seconds, optimizer_s, logged_s = (list(column) for column in zip(*(medians[i] for i in range(len(layouts)))))
    return ProbeTimes(seconds, optimizer_s, message_s, baseline, peak if together else None, logged_s)


def describe(layout: Config) -> str:
    compiled = " compiled" if layout.train.compile is not False else ""  # calibration's probes: all eager but one
    return (
        f"{layout.layout.text()} micro_batch {layout.train.micro_batch} x {layout.accumulation_steps} "
        f"recompute {layout.recompute}{compiled}"
    )


def _torchrun(layouts: list[Config], *, steps: int, timeout: float) -> dict:
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
    """torchrun worker: time every layout in CONFIGS on one process group; rank 0 writes the times,
    the message floor and its memory before any model to OUT."""
    configs, out, steps = argv
    layouts = [Config.model_validate(data) for data in json.loads(Path(configs).read_text())]
    mesh = init_mesh(layouts[0].layout)
    try:
        baseline = runtime_bytes(layouts[0], mesh.device)
        message_s = statistics.median(message_seconds(mesh.device) for _ in range(5))
        times = []
        for layout in layouts:
            if layout.layout != mesh.layout:  # the same processes in another shape
                mesh = mesh_on(layout.layout, mesh.device)
            times.append(dataclasses.asdict(time_steps(layout, mesh, steps=int(steps))))
    finally:
        shutdown()
    if os.environ.get("RANK") == "0":
        peak = peak_rss_bytes() if mesh.device.type == "cpu" else None
        result = {"times": times, "message_s": message_s, "runtime_bytes": baseline, "peak_bytes": peak}
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    probe_worker(sys.argv[1:])
    end_worker(0)
