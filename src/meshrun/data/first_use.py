"""Data prepared on a job's first use: the embedded corpus, `data.sources` or the example pairs,
written once into `data.dir` (or its default folder); data that is already there is never touched."""

from __future__ import annotations

from pathlib import Path

from meshrun.config.schema import Config
from meshrun.data.locations import data_dir, reads_in_place
from meshrun.data.prepare import default_sources, is_prepared, prepare
from meshrun.files.console import say


def prepare_on_first_use(cfg: Config) -> Path | None:
    """Prepare the embedded corpus (or `data.sources`) if this job's data folder holds none yet;
    returns the folder it prepared (None: prepared before, or read in place). Other formats and
    mixtures are read in place. (`preflight.check_data_source` has refused a `data.dir` with
    nothing to prepare.)"""
    path = data_dir(cfg)
    if reads_in_place(cfg) or is_prepared(path):
        return None
    if cfg.data.pairs:
        from meshrun.data.pairs import example_pairs, prepare_pairs, read_pairs

        say(f"preparing text pairs in {path} (first use)")
        prepare_pairs(
            read_pairs(cfg.data.sources) if cfg.data.sources else example_pairs(),
            path,
            val_fraction=cfg.data.val_fraction,
            reuse=True,  # another job on this data.dir may have prepared it meanwhile
        )
        return path
    tokenizer = cfg.data.tokenizer or "byte"
    say(f"preparing {tokenizer} data in {path} (first use)")
    trained = tokenizer.startswith("bpe:")
    prepare(
        cfg.data.sources or default_sources(),
        path,
        val_fraction=cfg.data.val_fraction,
        tokenizer="byte" if trained else tokenizer,
        train_tokenizer=tokenizer if trained else None,
        reuse=True,
    )
    return path
