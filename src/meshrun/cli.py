"""`meshrun` command line: parse, then hand over to job / data modules. Exit 2 = bad input."""

from __future__ import annotations

import argparse
import sys

from meshrun.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrun", description="DDP x pipeline-parallel Transformer training.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job (starts torchrun itself when needed)")
    train.add_argument("config", nargs="?", help="YAML config; default: the packaged configs/default.yaml")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")
    train.add_argument("--dry-run", action="store_true", help="validate and print the plan, start nothing")
    data = sub.add_parser("prepare-data", help="turn text files into byte-level token memmaps")
    data.add_argument("--source", dest="sources", action="append", default=[], metavar="PATH_OR_GLOB",
                      help="files, folders or globs (repeatable); default: the Python standard library")
    data.add_argument("--out", required=True, help="output folder (must not hold a prepared dataset)")
    data.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out for validation")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare-data":
            from meshrun.data.prepare import default_sources, prepare

            if not 0 < args.val_fraction < 0.5:
                raise ConfigError(f"--val-fraction must be in (0, 0.5), got {args.val_fraction}")
            try:
                meta = prepare(args.sources or default_sources(), args.out, val_fraction=args.val_fraction)
            except OSError as exc:
                raise ConfigError(f"cannot prepare data in {args.out}: {exc.strerror or exc}") from None
            print(f"wrote {meta['train_tokens']} train and {meta['val_tokens']} val tokens from {meta['num_files']} files to {args.out}")
            return 0
        cfg = load_config(args.config, args.overrides)
        from meshrun import job  # imports torch: after the config checks, so typos fail fast

        if args.dry_run:
            job.preflight(cfg)
            print(job.describe(cfg))
            return 0
        worker_args = ["train", *([args.config] if args.config else []), *(f"--set={o}" for o in args.overrides)]
        return job.train(cfg, worker_args)
    except ConfigError as exc:
        print(f"meshrun: error: {' '.join(str(exc).split())}", file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:
        return 130
