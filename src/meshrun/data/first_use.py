"""Data prepared on a job's first use: the embedded corpus, `data.sources`, the example pairs or
the example labelled texts or the example series or protein-like sequences, written once into `data.dir` (or its default folder); data that is already there is never touched."""

from __future__ import annotations

import contextlib
from pathlib import Path

from meshrun.config.schema import Config
from meshrun.data.locations import data_dir, reads_in_place
from meshrun.data.prepare import is_prepared, prepare
from meshrun.data.proteins import token_sources
from meshrun.errors import ConfigError
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
    if cfg.task == "classification":
        prepare_labelled(cfg, path)
        return path
    if cfg.task == "regression":  # preflight refused data.sources and an unprepared data.dir
        prepare_example_series(cfg, path)
        return path
    tokenizer = cfg.data.tokenizer or "byte"
    say(f"preparing {tokenizer} data in {path} (first use)")
    trained = tokenizer.startswith("bpe:")
    task = "masked_lm" if cfg.task == "masked_lm" else "causal_lm"  # masked_lm's meta.json adds the mask token
    with token_sources(cfg.data.sources, task) as sources:  # none: the task's example
        prepare(
            sources,
            path,
            val_fraction=cfg.data.val_fraction,
            tokenizer="byte" if trained else tokenizer,
            train_tokenizer=tokenizer if trained else None,
            reuse=True,
            task=task,
        )
    return path


def prepare_labelled(cfg: Config, path: Path) -> None:
    """task classification: `data.sources` (their `text` and `label` fields), else the standard
    library's docstring lines labelled by package (data/labelled.py), prepared with data.tokenizer."""
    from meshrun.data.labelled import example_examples, prepare_classification, read_examples
    from meshrun.data.prepare import AlreadyPrepared

    tokenizer = cfg.data.tokenizer or "byte"
    if tokenizer.startswith("bpe:"):
        raise ConfigError(
            f"data.tokenizer {tokenizer}: task classification does not train a tokenizer; give a trained one or byte"
        )
    say(f"preparing labelled texts ({tokenizer}) in {path} (first use)")
    sources = cfg.data.sources
    rows = read_examples(sources, text_field="text", label_field="label", flag="data.sources") if sources else None
    with contextlib.suppress(AlreadyPrepared):  # another job on this data.dir prepared it while this one waited
        examples = rows or example_examples()
        prepare_classification(
            examples, None, path, val_fraction=cfg.data.val_fraction, tokenizer=tokenizer, sources=sources
        )


def prepare_example_series(cfg: Config, path: Path) -> None:
    """task regression with no data.dir: the generated seasonal series (data/series.py example_series)."""
    from meshrun.data.prepare import AlreadyPrepared
    from meshrun.data.series import EXAMPLE_COLUMNS, example_series, prepare_regression

    say(f"preparing the example series in {path} (first use)")
    with contextlib.suppress(AlreadyPrepared):  # another job on this folder prepared it while this one waited
        prepare_regression(
            [example_series()],
            list(EXAMPLE_COLUMNS),
            path,
            seq_len=cfg.model.seq_len,
            horizon=cfg.task_options.horizon,
            val_fraction=cfg.data.val_fraction,
        )
