"""What `meshrun train` does: check everything, then launch workers or be one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import torch
import yaml

from meshrun.checkpoint import check_resumable
from meshrun.config import Config
from meshrun.data.dataset import check_data
from meshrun.data.prepare import default_sources, is_prepared, prepare
from meshrun.distributed import in_launched_worker, init_mesh, shutdown
from meshrun.errors import ConfigError
from meshrun.launcher.torchrun import WORKER_ENV, torchrun_argv
from meshrun.metrics.report import say
from meshrun.models import build_model
from meshrun.models.hf_config import vocab_key, vocab_size
from meshrun.parallel.plan import stage_ids, stages_per_rank, static_split, validate_layout
from meshrun.training.preemption import PREEMPTED_EXIT_CODE, STOP_SIGNALS




def data_dir(cfg: Config) -> Path:
    if cfg.data.dir is not None:
        return Path(cfg.data.dir)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "meshrun" / "stdlib-bytes"


def ensure_data(cfg: Config) -> Path:
    """Prepare the embedded corpus (or `data.sources`) on first use; never touch existing data.
    Other formats and mixtures are read in place."""
    path = data_dir(cfg)
    if not cfg.data.mixture and cfg.data.format == "meshrun" and not is_prepared(path):
        if cfg.data.dir is not None and not cfg.data.sources:
            raise ConfigError(f"data.dir {path} holds no prepared dataset; run `meshrun prepare-data --out {path}` or set data.sources")
        say(f"preparing byte-level data in {path} (first use)")
        prepare(cfg.data.sources or default_sources(), path, val_fraction=cfg.data.val_fraction)
    check_data(cfg.data, path, seq_len=cfg.model.seq_len, model_vocab_size=vocab_size(cfg.model),
               vocab_key=vocab_key(cfg.model))
    return path


def preflight(cfg: Config) -> None:
    """Every check that needs no worker: layout, model protocol, run directory."""
    validate_layout(cfg)
    with torch.device("meta"):
        model = build_model(cfg.model)
    if hasattr(model, "check_weights"):  # pretrained weights: present, and shaped as the config says
        model.check_weights()
    if Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
        raise ConfigError(f"run_dir {cfg.run_dir} is a file, not a folder; set run_dir to a new folder")
    check_writable(Path(cfg.run_dir))
    check_readable(data_dir(cfg))
    existing = Path(cfg.run_dir) / "config.json"
    if existing.exists():
        if cfg.train.resume == "none":
            raise ConfigError(f"run_dir {cfg.run_dir} already holds a run; set train.resume=auto to continue it, or a new run_dir")
        check_same_model(existing, cfg)
    if cfg.train.resume not in ("auto", "none") and not (Path(cfg.train.resume) / "manifest.json").is_file():
        raise ConfigError(f"train.resume {cfg.train.resume} is not a complete checkpoint folder (no manifest.json)")
    if in_launched_worker() and int(os.environ["WORLD_SIZE"]) != cfg.world_size:
        raise ConfigError(
            f"world size {os.environ['WORLD_SIZE']} does not match parallel.dp x parallel.pp = "
            f"{cfg.parallel.dp} x {cfg.parallel.pp}; launch {cfg.world_size} processes or change parallel.dp / parallel.pp"
        )


def check_writable(run_dir: Path) -> None:
    """run_dir (or the nearest folder above it that exists) takes a new file. Probed with a real
    file: permission bits say nothing for root, and a read-only mount refuses root too."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run_dir {run_dir} lies under {existing}, which is a file; set run_dir to a folder path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"run_dir {run_dir} is not writable ({existing}: {exc.strerror}); "
                          "fix its permissions or set run_dir to a writable folder") from None


def check_readable(path: Path) -> None:
    """Every file of an existing data folder can be opened and read (workers would fail later)."""
    if not path.is_dir():
        return  # missing data is prepared or reported by ensure_data
    try:
        for entry in path.iterdir():
            if entry.is_file():
                with entry.open("rb") as f:
                    f.read(1)
    except OSError as exc:
        raise ConfigError(f"data.dir {path} is not readable ({exc.filename}: {exc.strerror}); "
                          "fix its permissions or point data.dir at a readable copy") from None


def check_same_model(existing: Path, cfg: Config) -> None:
    """A run directory continues only a meshrun run of the same model (any dp x pp layout)."""
    try:
        before = Config.model_validate(json.loads(existing.read_text())).model
    except ValueError:
        raise ConfigError(
            f"run_dir {cfg.run_dir} already holds files that are not a meshrun run ({existing.name}); "
            "set run_dir to a new folder"
        ) from None
    for key, value in cfg.model.model_dump(mode="json").items():
        if getattr(before, key) != getattr(cfg.model, key):
            raise ConfigError(
                f"run_dir {cfg.run_dir} holds a run of a different model (model.{key} is {getattr(before, key)!r} there, "
                f"{value!r} here); use the same model settings or a new run_dir"
            )


def describe_split(cfg: Config) -> list[str] | None:
    """Blocks held by each pipeline rank, for display (None: no pipeline, or measured at start)."""
    par = cfg.parallel
    split = static_split(cfg) if par.pp > 1 else None
    if split is None:
        return None
    per_rank = stages_per_rank(par.schedule, par.virtual_stages)
    return [" + ".join(str(split[s]) for s in stage_ids(rank, par.pp, per_rank)) for rank in range(par.pp)]


def describe(cfg: Config) -> str:
    """The resolved config, the process layout and the batch maths (for --dry-run)."""
    par, train = cfg.parallel, cfg.train
    lines = [yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip(), "", "layout:"]
    lines.append(f"  world size {cfg.world_size} = dp {par.dp} x pp {par.pp} (rank = pp_rank * dp + dp_rank)")
    split = describe_split(cfg)
    for stage in range(par.pp):
        ranks = list(range(stage * par.dp, (stage + 1) * par.dp))
        lines.append(f"  pipeline rank {stage}: ranks {ranks}" + (f", blocks {split[stage]}" if split else ""))
    lines += [
        "batch:",
        f"  global batch {train.global_batch} samples = micro batch {train.micro_batch} x dp {par.dp} "
        f"x accumulation steps {cfg.accumulation_steps}",
        f"  tokens per step {cfg.tokens_per_step} (seq_len {cfg.model.seq_len})",
    ]
    return "\n".join(lines)


def train(cfg: Config, worker_args: list[str]) -> int:
    preflight(cfg)
    if in_launched_worker():
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            ensure_data(cfg)
        return run_worker(cfg)
    ensure_data(cfg)
    with torch.device("meta"):  # a run that cannot resume stops before any worker exists
        check_resumable(cfg.run_dir, cfg.train.resume, build_model(cfg.model))
    if cfg.world_size == 1 and cfg.launch.nnodes == 1 and cfg.launch.max_restarts == 0:
        return outcome(cfg, run_worker(cfg))  # one process needs no torchrun (nor its restarts)
    argv = torchrun_argv(cfg, worker_args)
    say(f"starting {cfg.world_size} workers: {' '.join(argv[1:])}")
    code, stop_requested = run_torchrun(argv, env={**os.environ, **WORKER_ENV})
    return outcome(cfg, 0 if stop_requested else code)


def run_torchrun(argv: list[str], *, env: dict[str, str]) -> tuple[int, bool]:
    """Run torchrun, relaying a stop request sent to this process (a container's PID 1, a
    scheduler) as SIGTERM: torchrun passes SIGTERM on to its workers, which checkpoint and
    stop (torchrun itself then exits non-zero); it has no handler for SIGUSR1 and would die of it.
    Returns torchrun's exit code and whether a stop was relayed."""
    proc = subprocess.Popen(argv, env=env)
    relayed: list[int] = []

    def relay(signum: int, frame: object) -> None:
        relayed.append(signum)
        proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, relay) for sig in STOP_SIGNALS}
    try:
        return proc.wait(), bool(relayed)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def outcome(cfg: Config, code: int) -> int:
    """Workers that stopped early on request exit 0 (so torchrun does not restart them); tell
    the caller with PREEMPTED_EXIT_CODE, since only a finished run writes summary.json."""
    if code == 0 and not (Path(cfg.run_dir) / "summary.json").exists():
        return PREEMPTED_EXIT_CODE
    return code


def run_worker(cfg: Config) -> int:
    from meshrun.training.trainer import Trainer  # heavy imports only in workers

    mesh = init_mesh(dp=cfg.parallel.dp, pp=cfg.parallel.pp)
    trainer = None
    try:
        torch.distributed.barrier()  # data prepared by every node's local rank 0
        trainer = Trainer(cfg, mesh, data_dir(cfg))
        trainer.train()
        return 0
    finally:
        if trainer is not None:
            trainer.close()
        shutdown()
