"""Checks of command-line arguments, before torch is imported: one line naming the flag, exit 2."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from meshrun.errors import ConfigError
from meshrun.files.writable import check_writable_parent
from meshrun.hardware.peaks import SHORT_NAMES


def check_plan_args(args: argparse.Namespace) -> None:
    """`plan` arguments, checked before torch is imported."""
    for flag, value in (
        ("--gpus", args.gpus),
        ("--nodes", args.nodes),
        ("--top", args.top),
        ("--steps", args.steps),
        ("--rounds", args.rounds),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if args.gpus % args.nodes:
        raise ConfigError(f"--nodes ({args.nodes}) must divide --gpus ({args.gpus}); change one of them")
    if not 0 <= args.margin < 1:
        raise ConfigError(f"--margin must be in [0, 1) (a share of device memory), got {args.margin}")
    for flag, value in (
        ("--memory-gb", args.memory_gb),
        ("--intra-gbs", args.intra_gbs),
        ("--inter-gbs", args.inter_gbs),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be a positive number, got {value}")
    if args.gpu and args.gpu.lower() != "cpu" and args.gpu.lower() not in SHORT_NAMES:
        raise ConfigError(f"--gpu: unknown GPU {args.gpu!r}: use one of {', '.join(SHORT_NAMES)}, or cpu")
    if args.write and Path(args.write).exists():
        raise ConfigError(f"--write {args.write} already exists; choose a new file name (plan never overwrites)")
    if args.write:
        check_writable_parent("--write", args.write)
    if args.calibration and not args.calibrate and not Path(args.calibration).is_file():
        raise ConfigError(f"--calibration {args.calibration} is not a file; pass one `meshrun plan --calibrate` wrote")
    if args.run and not (Path(args.run) / "config.json").is_file():
        raise ConfigError(f"--run {args.run} holds no config.json; pass a meshrun run directory")


def check_parity_args(args: argparse.Namespace) -> None:
    """`parity` arguments, checked before torch is imported."""
    if len(args.configs) > 2:
        raise ConfigError(f"parity takes one config (for both runs) or two (A and B), got {len(args.configs)}")
    for config in args.configs:
        if not Path(config).is_file():
            raise ConfigError(f"config {config} is not a file; pass A.yaml B.yaml, or one config for both runs")
    for flag, value in (("--steps", args.steps), ("--layers", args.layers)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    out = Path(args.out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"--out {args.out} exists; parity trains into a new folder: choose another --out")
    if not out.exists():
        check_writable_parent("--out", args.out)


def check_checkpoint_args(args: argparse.Namespace) -> None:
    """`export` / `sample` / `predict` arguments, checked before torch is imported."""
    if not Path(args.checkpoint).exists():
        raise ConfigError(f"{args.checkpoint} does not exist; pass a run directory or a checkpoint folder")
    if args.command == "predict":
        check_predict_args(args)
        return
    if args.command == "export":
        if args.merge and not args.hf:
            raise ConfigError("--merge goes with --hf OUT_DIR: a model.lora run's full weights, adapters merged in")
        flag = next(f for f in ("hf", "adapter", "out") if getattr(args, f))  # argparse: exactly one
        check_export_target(f"--{flag}", getattr(args, flag))
        return
    if args.tokens < 1:
        raise ConfigError(f"--tokens must be at least 1 (tokens to generate), got {args.tokens}")
    if not math.isfinite(args.temperature) or not 0 <= args.temperature <= 1000:
        raise ConfigError(f"--temperature must be a number in [0, 1000] (0 = greedy), got {args.temperature}")
    if not -(2**63) <= args.seed < 2**64:
        raise ConfigError(f"--seed must fit in 64 bits, got {args.seed}")
    if args.beam < 1:
        raise ConfigError(f"--beam must be at least 1 (1 = greedy), got {args.beam}")
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        raise ConfigError(f"--tokenizer {args.tokenizer} does not exist; give a tokenizer.json or a model folder")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 = all tokens), got {args.top_k}")
    for flag, text in (("--prompt", args.prompt), ("--chat", args.chat or "")):
        _check_utf8(flag, text)
    if args.chat is not None and args.beam > 1:
        raise ConfigError("--beam is for encoder-decoder models; sample --chat with --temperature (0 = greedy)")


def check_predict_args(args: argparse.Namespace) -> None:
    """`predict`: UTF-8 texts, or an existing .csv and a new --out .csv (never over a file)."""
    if args.text is not None:
        if args.out is not None:
            raise ConfigError("--out names the forecast file of --csv; --text prints its labels: drop --out")
        for text in args.text:
            _check_utf8("--text", text)
        return
    if not Path(args.csv).is_file():
        raise ConfigError(f"--csv {args.csv} is not a file; give the .csv of past rows to forecast from")
    if not args.csv.lower().endswith(".csv"):
        raise ConfigError(f"--csv {args.csv}: give a .csv file (a header line naming the columns)")
    flag = "--out" if args.out is not None else "the forecast file"
    out = forecast_path(args.csv, args.out)
    if not out.name.lower().endswith(".csv"):
        raise ConfigError(f"--out {args.out}: name a .csv file")
    if out.exists():
        raise ConfigError(f"{flag} {out} already exists (meshrun never writes over a file); pass a new --out FILE.csv")
    check_writable_parent(flag, str(out))


def forecast_path(csv: str, out: str | None) -> Path:
    """Where `predict --csv` writes: --out, else the input's name with .forecast.csv, beside it."""
    return Path(out) if out is not None else Path(csv).with_name(f"{Path(csv).name[: -len('.csv')]}.forecast.csv")


def _check_utf8(flag: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as surrogate escapes
        raise ConfigError(f"{flag} is not valid UTF-8 text; pass it as UTF-8") from None


def check_export_target(flag: str, out: str) -> None:
    """Where `export` writes: a new path (never over a file or folder), the right suffix for a
    file, below a folder this process can write; found before the checkpoint is consolidated."""
    path = Path(out)
    if path.exists():
        raise ConfigError(f"{flag} {out} already exists; choose another {flag}")
    if flag == "--out" and path.suffix not in (".safetensors", ".pt", ".pth"):
        raise ConfigError(f"--out {out}: use a .safetensors or .pt file name")
    check_writable_parent(flag, out)


def check_supervised_args(args: argparse.Namespace) -> None:
    """`prepare-data --chat / --prompt-completion` arguments, before anything is read."""
    kind = "--chat" if args.chat else "--prompt-completion"
    others = [
        flag
        for flag, on in (("--prompt-completion", args.chat and args.prompt_completion), ("--pairs", args.pairs))
        if on
    ]
    if others:
        raise ConfigError(f"{kind} excludes {others[0]}; pass one")
    if not args.sources and not args.chat:  # --chat without --source: the built-in example conversations
        raise ConfigError(f"{kind} needs --source (.jsonl, .parquet or datasets folders)")
    if args.tokenizer == "byte" or args.train_tokenizer:
        raise ConfigError(f"{kind} needs --tokenizer MODEL_FOLDER (the tokenizer the model was trained with)")
    if args.chat_template and not args.chat:
        raise ConfigError("--chat-template applies to --chat only (prompt/completion text is not templated)")
    if args.max_len is None or args.max_len < 2:
        got = "none" if args.max_len is None else args.max_len
        raise ConfigError(f"{kind} needs --max-len TOKENS >= 2 (the model.seq_len you will train with), got {got}")
