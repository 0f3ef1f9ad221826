"""Where a job's data lives: the folder it prepares or reads (`data.dir`, else a cache folder named by
the tokenizer), the folder it trains on, and which formats are read in place. The one home of this
rule: the launcher, the trainer, `sample` and the run-directory checks all ask here."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from meshrun.config.schema import Config


def cache_root() -> Path:
    """meshrun's cache folder: $XDG_CACHE_HOME/meshrun, else ~/.cache/meshrun."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshrun"


def data_dir(cfg: Config) -> Path:
    """The folder a job prepares or reads: `data.dir`, else a cache folder named by the tokenizer."""
    if cfg.data.dir is not None:
        return Path(cfg.data.dir)
    if cfg.data.pairs:
        name = "stdlib-camelcase"
    elif cfg.task == "classification":  # the docstring example's labelled rows
        name = f"stdlib-docstrings-{_tokenizer_slug(cfg.data.tokenizer)}"
    elif cfg.task == "regression":  # the generated series, its validation tail held out as the job asks
        name = f"example-series-h{cfg.task_options.horizon}-v{cfg.data.val_fraction}"
    elif cfg.task == "masked_lm":  # the generated protein-like sequences
        name = f"example-proteins-{_tokenizer_slug(cfg.data.tokenizer)}-v{cfg.data.val_fraction}"
    else:
        name = f"python-stdlib-{_tokenizer_slug(cfg.data.tokenizer)}"
    return cache_root() / name


def training_data_dir(cfg: Config) -> Path:
    """The folder the model trains on (a mixture's first source)."""
    return Path(cfg.data.mixture[0].dir) if cfg.data.mixture else data_dir(cfg)


def _tokenizer_slug(tokenizer: str | None) -> str:
    """A folder-name part per tokenizer, so corpora tokenized differently never share a cache folder."""
    if tokenizer in (None, "byte"):
        return "byte"
    if tokenizer.startswith("bpe:"):
        return tokenizer.replace(":", "")
    return f"{Path(tokenizer).name}-{hashlib.sha256(str(Path(tokenizer).resolve()).encode()).hexdigest()[:8]}"


def reads_in_place(cfg: Config) -> bool:
    """Mixtures and other tools' formats are read as they are; nothing is prepared for them."""
    return bool(cfg.data.mixture) or cfg.data.format != "meshrun"
