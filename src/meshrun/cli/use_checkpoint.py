"""`export` and `sample`: a trained model used on one process, from any layout's checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from torch import nn

from meshrun.checkpoint.dcp import CONFIG, full_model_state, read_manifest, verify
from meshrun.checkpoint.export import export
from meshrun.checkpoint.resume import checkpoint_dir
from meshrun.cli.arguments import check_export_target, forecast_path
from meshrun.config.schema import Config, check_code_trusted
from meshrun.config.tasks import GENERATIVE_TASKS
from meshrun.errors import CheckpointError, ConfigError
from meshrun.files.atomic import write_atomic
from meshrun.files.json_reader import read_json
from meshrun.preflight import preflight
from meshrun.tasks import Predict


def load_full_model(
    run_or_checkpoint: str | Path, *, factory: str | None = None, trust_code: bool = False
) -> tuple[nn.Module, Config, Path]:
    """The whole model on the CPU with the checkpoint's weights, its config and the folder used.

    The folder is verified against its manifest before anything in it is used. A
    `model.factory` named by the checkpoint's config.json is code chosen by whoever wrote the
    folder: it runs only when the user names a factory (`factory`) or says `trust_code`.
    """
    folder = checkpoint_dir(run_or_checkpoint)
    verify(folder)
    try:
        cfg = Config.model_validate(read_json(folder / CONFIG))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder} has no usable {CONFIG} ({' '.join(str(exc).split())})") from None
    if factory is not None:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"factory": factory})})
    else:
        instead = f"name the factory you mean with --set model.factory={cfg.model.factory}, or "
        check_code_trusted(cfg, folder / CONFIG, trust_code=trust_code, instead=instead)
    model = preflight(cfg, scope="model")  # built on the meta device (with a LoRA run's adapters)
    saved_base = read_manifest(folder).get("base")
    if saved_base is not None:  # a LoRA checkpoint of the adapters only
        return adapters_on_base(cfg, folder, saved_base).eval(), cfg, folder
    model.to_empty(device="cpu")
    model.load_state_dict(full_model_state(model, folder))
    return model.eval(), cfg, folder


def adapters_on_base(cfg: Config, folder: Path, saved_base: object) -> nn.Module:
    """The whole model of an adapter-only checkpoint: the base read from its folder (refused unless
    it holds the weights the adapters were trained on) in the dtype training held it in
    (model.lora.base_dtype, with the precision the run resolved), the adapters from the checkpoint."""
    from meshrun.models.lora import add_adapters, base_identity, check_same_base, is_adapter
    from meshrun.parallel.materialise import meta_stage

    base = base_identity(cfg.model)
    if base is None or cfg.model.lora is None:
        raise CheckpointError(
            f"checkpoint {folder} holds LoRA adapters only, but its config names no base with weights"
        )
    check_same_base(folder, saved_base, base, fix="put back the folder they were trained on to use them")
    model = meta_stage(cfg, layers=None, first=True, last=True)
    model.to_empty(device="cpu")
    model.init_weights(cfg.train.seed)  # the folder's weights
    add_adapters(model, cfg.model.lora, seed=None)
    model.load_state_dict(full_model_state(model, folder, keep=is_adapter), strict=False)
    return model


def saved_at(folder: Path) -> str:
    """'step N (FOLDER)', N from the checkpoint's manifest: a folder copied or renamed away from
    step-N keeps its step there."""
    step = read_manifest(folder).get("step")
    return f"step {step} ({folder})" if type(step) is int else str(folder)


def factory_override(overrides: list[str]) -> str | None:
    """The factory named with `--set model.factory=...` (the last one wins), refusing other keys."""
    factory = None
    for override in overrides:
        key, sep, value = override.partition("=")
        if key.strip() != "model.factory" or not sep or not value.strip():
            raise ConfigError(f"--set {override}: export and sample take only --set model.factory=MODULE:FUNCTION")
        factory = value.strip()
    return factory


def predict_fn(cfg: Config) -> Predict:
    """The job's task's predict command for texts, refused in one line for a task that has none."""
    from meshrun.tasks import task_for

    task = task_for(cfg.task)
    if task.predict is None:
        raise ConfigError(
            f"meshrun predict --text labels texts with a classification model; this is a {cfg.task} model"
            + (
                ": use meshrun sample"
                if cfg.task in GENERATIVE_TASKS
                else ": pass --csv FILE with its columns to forecast"
                if task.forecast is not None
                else ", which has no predict command in this version"
            )
        )
    return task.predict


def predictions(model: nn.Module, cfg: Config, data: Path, texts: list[str]) -> str:
    """One line per text: its label, that label's probability, the text (tab-separated)."""
    rows = predict_fn(cfg)(model, cfg, data, texts)
    return "\n".join(f"{label}\t{probability:.4f}\t{text}" for (label, probability), text in zip(rows, texts))


def write_forecast(model: nn.Module, cfg: Config, data: Path, table: Path, out: Path) -> str:
    """The forecast from `table`'s last rows written to `out`, a new file (atomically, never over one
    that exists); the line that says where."""
    from meshrun.tasks import task_for

    forecast = task_for(cfg.task).forecast
    if forecast is None:
        use = (
            ": pass --text TEXT to label texts"
            if cfg.task == "classification"
            else ": use meshrun sample"
            if cfg.task in GENERATIVE_TASKS
            else ", which has no predict command in this version"
        )
        raise ConfigError(f"meshrun predict --csv forecasts with a regression model; this is a {cfg.task} model{use}")
    text = forecast(model, cfg, data, table)
    try:
        write_atomic(out, text, replace=False)
    except FileExistsError:
        raise ConfigError(f"{out} appeared while the forecast was computed; pass a new --out FILE.csv") from None
    steps = f"{cfg.task_options.horizon} step" + "s" * (cfg.task_options.horizon > 1)
    return f"wrote the forecast of the next {steps} (from the last {cfg.model.seq_len} rows of {table}) to {out}"


def use_checkpoint(args: argparse.Namespace) -> int:
    """`export`, `sample` and `predict`: one process, any layout's checkpoint (arguments checked by the caller, before torch)."""
    from meshrun.generation.sample import data_card, sample

    trust = {"factory": factory_override(args.overrides), "trust_code": args.trust_code}
    try:
        if args.command == "export" and args.hf:
            from meshrun.models.hf_export import export_hf

            model, cfg, folder = load_full_model(args.checkpoint, **trust)
            out = export_hf(model, cfg.model, Path(args.hf), data=data_card(cfg, folder), merge=args.merge)
            merged = " (the LoRA adapters merged into its weights)" if args.merge else ""
            print(f"exported {saved_at(folder)} as a Hugging Face model{merged} to {Path(out).absolute()}")
            return 0
        if args.command == "export" and args.adapter:
            from meshrun.models.lora import export_adapter

            model, cfg, folder = load_full_model(args.checkpoint, **trust)
            out = export_adapter(model, cfg.model, Path(args.adapter))
            print(f"exported the LoRA adapters of {saved_at(folder)} as a PEFT adapter folder to {out.absolute()}")
            return 0
        if args.command == "export":
            check_export_target("--out", args.out)
            model, cfg, folder = load_full_model(args.checkpoint, **trust)
            out = export(model, cfg, folder, args.out)
            print(f"exported {saved_at(folder)} to {out.absolute()}")
            return 0
        model, cfg, folder = load_full_model(args.checkpoint, **trust)
        if args.command == "predict" and args.csv is not None:
            out = forecast_path(args.csv, args.out)
            print(write_forecast(model, cfg, data_card(cfg, folder), Path(args.csv), out))
            return 0
        if args.command == "predict":
            print(predictions(model, cfg, data_card(cfg, folder), args.text))
            return 0
        if cfg.task not in GENERATIVE_TASKS:
            raise ConfigError(
                f"{folder} is a {cfg.task} model, which does not generate text: "
                f"meshrun sample continues {' and '.join(GENERATIVE_TASKS)} models"
            )
        if args.chat is not None:
            from meshrun.generation.chat import answer

            text = answer(
                model,
                cfg,
                args.chat,
                data=data_card(cfg, folder),
                num_tokens=args.tokens,
                temperature=args.temperature,
                top_k=args.top_k or None,
                seed=args.seed,
            )
            print(text)
            return 0
        text = sample(
            model,
            cfg,
            args.prompt,
            num_tokens=args.tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            seed=args.seed,
            beam=args.beam,
            data=data_card(cfg, folder),
            tokenizer=args.tokenizer,
        )
        print(text, end="" if text.endswith("\n") else "\n")  # one newline at the end, never two
        return 0
    except CheckpointError as exc:  # a bad path given on the command line
        raise ConfigError(str(exc)) from None
    except OSError as exc:  # export --hf into a place that cannot be written after all
        raise ConfigError(
            f"{exc.filename or 'the output'} cannot be written ({exc.strerror}); choose another path"
        ) from None
