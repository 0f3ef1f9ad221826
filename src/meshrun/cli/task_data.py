"""`meshrun prepare-data --task ...`: which flags each task takes, and the record tasks
(classification, regression) prepared from their tables. Torch-free."""

from __future__ import annotations

import argparse

from meshrun.errors import ConfigError

# the flags of one task (None: not given), and the task that takes them
TASK_FLAGS = {
    "--label-field": ("label_field", "classification"),
    "--val-source": ("val_sources", "classification"),
    "--columns": ("columns", "regression"),
    "--time-column": ("time_column", "regression"),
    "--seq-len": ("seq_len", "regression"),
    "--horizon": ("horizon", "regression"),
}


def chosen_task(args: argparse.Namespace) -> str:
    """The task prepare-data prepares for; a flag of another task is refused rather than ignored."""
    task = args.task or ("seq2seq" if args.pairs else "causal_lm")
    if args.pairs and task != "seq2seq":
        raise ConfigError(f"--pairs prepares seq2seq pairs, not --task {task}; drop one of them")
    supervised = "--chat" if args.chat else "--prompt-completion" if args.prompt_completion else None
    if supervised and task != "causal_lm":
        raise ConfigError(f"{supervised} prepares causal_lm documents with a loss mask, not --task {task}; pass one")
    for flag, (name, owner) in TASK_FLAGS.items():
        if getattr(args, name) not in (None, []) and task != owner:
            raise ConfigError(
                f"{flag} is a flag of --task {owner}, not of --task {task}; drop it or pass --task {owner}"
            )
    if task == "regression" and (args.tokenizer != "byte" or args.train_tokenizer):
        raise ConfigError(
            "--tokenizer and --train-tokenizer do not apply to --task regression (numbers, not text); drop them"
        )
    if task == "classification" and args.train_tokenizer:
        raise ConfigError(
            f"--train-tokenizer does not apply to --task {task}; pass a trained --tokenizer PATH or bytes"
        )
    return task


# flags every kind of preparation parses: (attribute, the preparations that read it)
SHARED_FLAGS = {
    "--workers": ("workers", ("text",)),
    "--shard-tokens": ("shard_tokens", ("text", "supervised")),
    "--field": ("field", ("text", "classification")),
    "--source-field": ("source_field", ("seq2seq",)),
    "--target-field": ("target_field", ("seq2seq",)),
}


def check_flags_apply(args: argparse.Namespace, task: str) -> None:
    """A flag this preparation would not read is refused, not silently ignored (given: its value is
    not the parser's own default)."""
    from meshrun.cli.parser import build_parser

    defaults = build_parser().parse_args(["prepare-data", "--out", args.out])
    supervised = args.chat or args.prompt_completion
    kind = "supervised" if supervised else task if task in ("classification", "regression", "seq2seq") else "text"
    what = (
        ("--chat" if args.chat else "--prompt-completion")
        if supervised
        else "--pairs"
        if args.pairs
        else f"--task {task}"
    )
    for flag, (name, readers) in SHARED_FLAGS.items():
        if getattr(args, name) != getattr(defaults, name) and kind not in readers:
            raise ConfigError(f"{flag} does not apply to {what} (it does not read it); drop {flag}")


def prepare_records(args: argparse.Namespace, task: str) -> int:
    """classification or regression data into `--out`; prints one line saying what was written."""
    try:
        line = _classification(args) if task == "classification" else _regression(args)
    except OSError as exc:
        raise ConfigError(f"cannot prepare data in {args.out}: {exc.strerror or exc}") from None
    print(f"{line} to {args.out}")
    return 0


def _classification(args: argparse.Namespace) -> str:
    from meshrun.data.labelled import example_examples, prepare_classification, read_examples

    fields = {"text_field": args.field, "label_field": args.label_field or "label"}
    train = read_examples(args.sources, **fields, flag="--source") if args.sources else example_examples()
    val = read_examples(args.val_sources, **fields, flag="--val-source") if args.val_sources else None
    meta = prepare_classification(
        train, val, args.out, val_fraction=args.val_fraction, tokenizer=args.tokenizer, sources=args.sources
    )
    counts = ", ".join(f"{split} {info['examples']}" for split, info in meta["splits"].items())
    return f"prepared classification data ({counts} rows; {meta['num_labels']} labels; vocabulary {meta['vocab_size']})"


def _regression(args: argparse.Namespace) -> str:
    from meshrun.data.series import EXAMPLE_COLUMNS, example_series, prepare_regression, read_series

    if args.seq_len is None:
        raise ConfigError("--task regression needs --seq-len N: the past values each window holds (model.seq_len)")
    horizon = 1 if args.horizon is None else args.horizon
    for flag, value in (("--seq-len", args.seq_len), ("--horizon", horizon)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    columns = [name.strip() for name in (args.columns or "").split(",") if name.strip()]
    if args.sources:
        series, columns = read_series(args.sources, columns=columns, time_column=args.time_column)
    elif columns or args.time_column:
        raise ConfigError("--columns and --time-column name columns of --source files; the built-in example has none")
    else:
        series, columns = [example_series()], list(EXAMPLE_COLUMNS)
    meta = prepare_regression(
        series,
        columns,
        args.out,
        seq_len=args.seq_len,
        horizon=horizon,
        val_fraction=args.val_fraction,
        time_column=args.time_column,
    )
    return (
        f"prepared regression data ({len(series)} series, {meta['rows']} rows of {len(columns)} columns, "
        f"standardised by the training rows' mean and std; seq_len {args.seq_len}, horizon {horizon})"
    )
