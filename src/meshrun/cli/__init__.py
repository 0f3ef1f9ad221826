"""`meshrun` command line: parse, then hand over to job / data modules. Exit 2 = bad input."""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path
from typing import NoReturn

from meshrun.cli.arguments import (
    check_checkpoint_args,
    check_parity_args,
    check_plan_args,
    check_supervised_args,
)
from meshrun.cli.parser import build_parser
from meshrun.config.schema import load_config
from meshrun.errors import ConfigError, RunError
from meshrun.launcher.lifetime import end_worker, ends_itself
from meshrun.launcher.outcome import Interrupted, StoppedBeforeTraining, stops_end_the_launcher
from meshrun.launcher.torchrun import in_launched_worker
from meshrun.preflight import check_rendezvous, preflight
from meshrun.versions import check_torch_version, installed_torch_version, missing_extra


def _parity(args: argparse.Namespace) -> int:
    check_parity_args(args)
    from meshrun.cli.parity import run_parity  # the runs and the weights (torch) after the checks

    return run_parity(args)


def _plan(args: argparse.Namespace) -> int:
    check_plan_args(args)
    from meshrun.cli.plan import run_plan  # imports torch: after the checks

    return run_plan(args)


def _prepare_data(args: argparse.Namespace) -> int:
    from meshrun.cli.task_data import check_flags_apply, chosen_task, prepare_records
    from meshrun.data.prepare import describe_dataset, prepare
    from meshrun.data.proteins import token_sources

    if not 0 < args.val_fraction < 0.5:
        raise ConfigError(f"--val-fraction must be in (0, 0.5), got {args.val_fraction}")
    for flag, value in (("--workers", args.workers), ("--shard-tokens", args.shard_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    task = chosen_task(args)
    check_flags_apply(args, task)
    if args.chat or args.prompt_completion:
        return _prepare_supervised(args)
    if task in ("classification", "regression"):
        return prepare_records(args, task)
    if task == "seq2seq":
        if args.train_tokenizer:
            raise ConfigError("--train-tokenizer does not apply to --pairs; pass a trained --tokenizer PATH or bytes")
        return _prepare_pairs(args)
    try:
        with token_sources(args.sources, task) as sources:  # none: the task's example, as a job's first use
            meta = prepare(
                sources,
                args.out,
                val_fraction=args.val_fraction,
                field=args.field,
                tokenizer=args.tokenizer,
                train_tokenizer=args.train_tokenizer,
                workers=args.workers,
                shard_tokens=args.shard_tokens,
                task=task,
            )
    except OSError as exc:
        raise ConfigError(f"cannot prepare data in {args.out}: {exc.strerror or exc}") from None
    print(f"{describe_dataset(meta)} to {args.out}")
    return 0


def _prepare_pairs(args: argparse.Namespace) -> int:
    from meshrun.data.pairs import example_pairs, prepare_pairs, read_pairs

    pairs = (
        read_pairs(args.sources, source_field=args.source_field, target_field=args.target_field)
        if args.sources
        else example_pairs()
    )
    try:
        meta = prepare_pairs(pairs, args.out, val_fraction=args.val_fraction, tokenizer=args.tokenizer)
    except OSError as exc:
        raise ConfigError(f"cannot prepare data in {args.out}: {exc.strerror or exc}") from None
    counts = ", ".join(f"{split} {info['pairs']}" for split, info in meta["splits"].items())
    print(f"prepared text pairs ({counts}; vocabulary {meta['vocab_size']} with pad/bos/eos 0/1/2) to {args.out}")
    return 0


def _prepare_supervised(args: argparse.Namespace) -> int:
    """prepare-data --chat / --prompt-completion: the flags checked, then data/supervised.py."""
    check_supervised_args(args)
    from meshrun.data.supervised import SupervisedOptions, describe_documents, prepare_supervised

    if Path(args.tokenizer).is_dir():
        from meshrun.models.hf_config import check_model_files

        check_model_files(Path(args.tokenizer))  # every file transformers reads stays in the folder
    chat = args.chat
    options = SupervisedOptions(
        kind="chat" if chat else "prompt-completion",
        fields=(args.messages_field,) if chat else (args.prompt_field, args.completion_field),
        train_on=args.train_on,
        max_len=args.max_len,
        long=args.long,
    )
    try:
        meta = prepare_supervised(
            args.sources,
            args.out,
            options,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
        )
    except OSError as exc:
        raise ConfigError(f"cannot prepare data in {args.out}: {exc.strerror or exc}") from None
    print(f"{describe_documents(meta)} to {args.out}")
    return 0


def _slurm(args: argparse.Namespace) -> int:
    """Render the sbatch script for a config; print it, or submit it and print the job id."""
    from meshrun.files.console import say
    from meshrun.launcher.slurm import chosen, partition_cpus, render_sbatch, slurm_notes, submit

    cfg = load_config(args.config, args.overrides)
    script = render_sbatch(
        cfg,
        config=args.config,
        overrides=args.overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        account=args.account,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        node_cpus=None if args.cpus_per_task else partition_cpus(args.partition),
        mem=args.mem,
        job_name=args.job_name,
        signal_seconds=args.signal_seconds,
        sbatch_options=args.sbatch_options,
    )
    preflight(cfg)  # the same checks as `meshrun train`, before the job waits for nodes
    for note in [*chosen(script), *slurm_notes(cfg, nodes=args.nodes, time=args.time)]:
        say(note)
    if not args.submit:
        print(script, end="")
        return 0
    print(submit(script))
    return 0


def _k8s(args: argparse.Namespace) -> int:
    """Render the manifest for a config after the checks that need no cluster; print or write it."""
    from meshrun.files.console import say
    from meshrun.launcher.k8s import PodOptions, check_options, k8s_notes, render_manifest, write_manifest
    from meshrun.parallel.stages import validate_layout

    cfg = load_config(args.config, args.overrides)
    options = PodOptions(
        image=args.image,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        flavor=args.flavor,
        name=args.name,
        queue=args.queue,
        namespace=args.namespace,
        pvc=args.pvc,
        env=args.env,
        wandb_secret=args.wandb_secret,
        cpus=args.cpus,
        memory=args.memory,
        grace_seconds=args.grace_seconds,
    )
    check_options(cfg, options)  # every flag's check, before the model is built
    validate_layout(cfg)  # the run_dir and data live on the cluster's volume: the pods check them
    model = preflight(cfg, scope="model")
    weights = sum(p.numel() for p in model.parameters())
    checkpoint_bytes = 4 * (1 + cfg.train.optimizer_state()[0]) * weights  # fp32 weights + the optimizer's values
    manifest = render_manifest(cfg, options, checkpoint_bytes=checkpoint_bytes)
    for note in k8s_notes(cfg, options):
        say(note)
    if args.out is None:
        print(manifest, end="")
        return 0
    write_manifest(args.out, manifest)
    print(f"wrote {args.out}")
    return 0


_LAUNCH_FLAGS = (
    "nnodes",
    "nproc_per_node",
    "rdzv_endpoint",
    "rdzv_id",
    "local_addr",
    "host_node",
    "max_restarts",
    "rdzv_timeout",
)


def _launch_overrides(args: argparse.Namespace) -> list[str]:
    """Multi-node flags as `launch.*` overrides: validated like config keys, passed on to workers."""
    values = {name: getattr(args, name, None) for name in _LAUNCH_FLAGS}
    rank = getattr(args, "node_rank", None)
    if rank is not None:  # a node's index says whether it hosts the rendezvous, where names cannot
        if rank < 0 or values["host_node"] is not None:
            raise ConfigError(
                f"--node-rank {rank}: give an index >= 0, and not together with --host-node/--no-host-node"
            )
        values["host_node"] = rank == 0
    return [
        f"launch.{name}={str(value).lower() if isinstance(value, bool) else value}"
        for name, value in values.items()
        if value is not None
    ]


def _train(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, *_launch_overrides(args)]
    cfg = load_config(args.config, overrides)
    if not args.dry_run:  # the names must resolve here, before torchrun retries them for minutes
        check_rendezvous(cfg)
    model = preflight(cfg)
    if args.dry_run:
        from meshrun.planner.dry_run import describe_job  # imports torch (preflight did, after every torch-free check)

        print(describe_job(cfg, model))
        return 0
    from meshrun.cli import train as job

    worker_args = ["train", *([args.config] if args.config else []), *(f"--set={o}" for o in overrides)]
    code = job.train(cfg, worker_args, model)
    if code == 0 and not in_launched_worker():
        from meshrun.config.tasks import GENERATIVE_TASKS
        from meshrun.files.console import next_steps, say
        from meshrun.generation.sample import sample_prompt
        from meshrun.models.hf_config import is_hf

        offline = any((Path(cfg.run_dir) / "wandb").glob("offline-run-*"))  # what the run wrote, not meant
        prompt = sample_prompt(cfg) if cfg.task in GENERATIVE_TASKS else None
        say(next_steps(cfg.run_dir, offline_wandb=offline, prompt=prompt, hf=is_hf(cfg.model)))
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command not in ("prepare-data", "report"):  # the commands that run torch
            check_torch_version(installed_torch_version())
        if args.command == "prepare-data":
            return _prepare_data(args)
        if args.command == "report":
            from meshrun.metrics.compare import report

            print(report(args.runs, out=args.out, force=args.force))
            return 0
        if args.command in ("export", "sample", "predict"):
            check_checkpoint_args(args)  # before torch is imported
            from meshrun.cli.use_checkpoint import use_checkpoint  # imports torch

            return use_checkpoint(args)
        if args.command == "slurm":
            return _slurm(args)
        if args.command == "k8s":
            return _k8s(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "parity":
            return _parity(args)
        with contextlib.nullcontext() if in_launched_worker() else stops_end_the_launcher():
            return _train(args)
    except (StoppedBeforeTraining, Interrupted) as stop:
        print(f"meshrun: {stop}", file=sys.stderr)
        return stop.exit_code
    except (ConfigError, RunError) as exc:
        return _refuse(exc)
    except ModuleNotFoundError as exc:  # an optional package a command imports late (export --hf: transformers)
        if (missing := missing_extra(exc, f"meshrun {args.command}")) is None:
            raise
        return _refuse(missing)
    except KeyboardInterrupt:  # before a run started (training ends as Interrupted)
        if not in_launched_worker():  # a worker's SIGINT is the default: it does not get here
            print("meshrun: interrupted (Ctrl-C / SIGINT)", file=sys.stderr)
        return 130


def _refuse(exc: ConfigError | RunError) -> int:
    print(f"meshrun: error: {' '.join(str(exc).split())}", file=sys.stderr)  # always one line
    return 2 if isinstance(exc, ConfigError) else exc.exit_code


def run() -> NoReturn:
    """The process entry (the `meshrun` script, `python -m meshrun`, every worker): `main`, then
    an exit that skips the interpreter's last cyclic collection, which walks every object torch,
    sympy and matplotlib created (~1 s per process, paid by every worker of every launch). A worker
    started as a process (where it cannot be forked) ends as a forked one does: end_worker."""
    code = main()
    if in_launched_worker() and ends_itself():
        end_worker(code)
    gc.freeze()  # the objects stay uncollected; the process is ending and every file is closed
    raise SystemExit(code)
