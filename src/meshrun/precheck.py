"""Checks of a job that need no torch: the CLI runs them before `meshrun.job` (and so torch)
is imported, so layout, path and environment mistakes are answered in well under a second.
Checks that need torch (building the model, reading token files) stay in `job.preflight`."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from meshrun.config import Config
from meshrun.data.prepare import is_prepared
from meshrun.errors import ConfigError
from meshrun.plan import validate_layout


def in_launched_worker() -> bool:
    """True inside torchrun / Slurm-started workers (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def data_dir(cfg: Config) -> Path:
    if cfg.data.dir is not None:
        return Path(cfg.data.dir)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    name = "stdlib-camelcase" if cfg.data.pairs else f"python-stdlib-{_tokenizer_slug(cfg.data.tokenizer)}"
    return cache / "meshrun" / name


def _tokenizer_slug(tokenizer: str | None) -> str:
    """A folder-name part per tokenizer, so corpora tokenized differently never share a cache folder."""
    if tokenizer in (None, "byte"):
        return "byte"
    if tokenizer.startswith("bpe:"):
        return tokenizer.replace(":", "")
    return f"{Path(tokenizer).name}-{hashlib.sha256(str(Path(tokenizer).resolve()).encode()).hexdigest()[:8]}"


def check_job(cfg: Config) -> None:
    """Every torch-free check of `meshrun train` (with or without --dry-run)."""
    check_worker_env(cfg)
    validate_layout(cfg)
    check_run_dir(cfg)
    check_writable(Path(cfg.run_dir))
    check_data_source(cfg)
    check_observability(cfg)
    for path in [Path(source.dir) for source in cfg.data.mixture] or [data_dir(cfg)]:
        check_readable(path)


def check_observability(cfg: Config) -> None:
    """The tensorboard package for that backend; profiled ranks that exist."""
    if "tensorboard" in cfg.tracker.backends and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "tracker.backends names tensorboard, but the tensorboard package is not installed; "
            "pip install tensorboard, or remove it from tracker.backends"
        )
    stray = [rank for rank in cfg.profile.ranks or [] if rank >= cfg.world_size]
    if stray:
        raise ConfigError(
            f"profile.ranks {stray} do not exist: ranks are 0 to {cfg.world_size - 1} "
            f"(parallel.dp x parallel.pp = {cfg.world_size}); change profile.ranks"
        )


def check_worker_env(cfg: Config) -> None:
    """RANK and WORLD_SIZE make meshrun act as a torchrun worker: say so when they look stray."""
    if not in_launched_worker():
        return
    took = "RANK and WORLD_SIZE are set, so meshrun took this process for a torchrun worker"
    advice = "unset RANK and WORLD_SIZE to let meshrun start torchrun itself"
    world = os.environ["WORLD_SIZE"]
    if not world.isdigit():
        raise ConfigError(f"{took}, but WORLD_SIZE={world!r} is not a number; {advice}")
    if int(world) != cfg.world_size:
        raise ConfigError(
            f"{took}, but its world size {world} does not match parallel.dp x parallel.pp = {cfg.parallel.dp} x "
            f"{cfg.parallel.pp}; launch {cfg.world_size} processes, change parallel.dp / parallel.pp, or {advice}"
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(
            f"{took}, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set "
            f"(torchrun sets them); {advice}"
        )


def check_run_dir(cfg: Config) -> None:
    """The run directory is new, or holds a meshrun run of the same model to continue."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir {cfg.run_dir} is a file, not a folder; set run_dir to a new folder")
    existing = run_dir / "config.json"
    if existing.exists():
        if cfg.train.resume == "none":
            raise ConfigError(
                f"run_dir {cfg.run_dir} already holds a run; set train.resume=auto to continue it, or a new run_dir"
            )
        check_same_model(existing, cfg)
    if cfg.train.resume not in ("auto", "none") and not (Path(cfg.train.resume) / "manifest.json").is_file():
        raise ConfigError(f"train.resume {cfg.train.resume} is not a complete checkpoint folder (no manifest.json)")


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
        raise ConfigError(
            f"run_dir {run_dir} is not writable ({existing}: {exc.strerror}); "
            "fix its permissions or set run_dir to a writable folder"
        ) from None


def check_readable(path: Path) -> None:
    """Every file of an existing data folder can be opened and read (workers would fail later)."""
    if not path.is_dir():
        return  # missing data is prepared or reported by check_data_source / the readers
    try:
        for entry in path.iterdir():
            if entry.is_file():
                with entry.open("rb") as f:
                    f.read(1)
    except OSError as exc:
        raise ConfigError(
            f"data.dir {path} is not readable ({exc.filename}: {exc.strerror}); "
            "fix its permissions or point data.dir at a readable copy"
        ) from None


def check_data_source(cfg: Config) -> None:
    """A `data.dir` must hold a prepared dataset unless `data.sources` says what to prepare there
    (other formats and mixtures are read in place and checked by their readers)."""
    path = data_dir(cfg)
    if cfg.data.mixture or cfg.data.format != "meshrun":
        return
    if cfg.data.dir is not None and not cfg.data.sources and not is_prepared(path):
        raise ConfigError(
            f"data.dir {path} holds no prepared dataset; run `meshrun prepare-data --out {path}` or set data.sources"
        )
