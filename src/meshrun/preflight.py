"""Every check of a config that needs more than the config itself (the filesystem, the
environment, the model), in one function, `preflight`, run by `train`, `slurm`, `export`,
`sample` and `plan` before any work starts. Rules that need only the config are validators on
the schema (config.py, layout.py), so they hold for every Config however it was built.

This module imports no torch: `preflight` runs the torch-free checks first (layout, paths,
environment: answered in well under a second), then imports torch to build the model.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from meshrun.checkpoint.paths import checkpoint_root, complete_checkpoints
from meshrun.config.address import host_problem, port_problem, split_endpoint
from meshrun.config.model_sections import LoraSection
from meshrun.config.schema import Config
from meshrun.data.locations import data_dir, reads_in_place, training_data_dir
from meshrun.data.prepare import is_prepared
from meshrun.errors import ConfigError
from meshrun.files.json_reader import read_json
from meshrun.files.writable import check_writable
from meshrun.launcher.rerun import check_rerun
from meshrun.launcher.torchrun import in_launched_worker
from meshrun.models.hf_config import (
    check_hf_context_split,
    check_hf_tensor_split,
    hf_dir,
    num_layers,
)
from meshrun.parallel.stages import static_split, validate_layout
from meshrun.planner.model_size import check_model_size
from meshrun.versions import check_extras

if TYPE_CHECKING:
    from torch import nn


def preflight(cfg: Config, *, scope: Literal["job", "model"] = "job") -> nn.Module:
    """Refuse what would fail later, one line each (ConfigError). `job` (train, slurm): the
    environment, layout, run directory and data, then the model builds, its pretrained weights
    exist and the data fits it. `model` (export, sample, plan: nothing is trained): the model
    builds. Returns the model, built on the meta device."""
    if scope == "job":
        check_job(cfg)
    else:
        check_extras(cfg, trains=False)  # transformers for a Hugging Face model, before torch is imported
        check_model_size(cfg)  # sizes bounded before anything is built (check_job does it too)
    from meshrun.models.families import build_model, model_source  # imports torch: after every torch-free check
    from meshrun.models.protocol import check_weights

    if scope == "job":
        check_hf_tensor_split(cfg)
        check_hf_context_split(cfg)
    model = build_model(cfg.model)
    if scope == "job":
        if cfg.parallel.tp > 1:
            from meshrun.parallel.tensor import check_plan

            source = model_source(cfg.model)
            check_plan(model, cfg.parallel.tp, source, sequence_parallel=cfg.parallel.sequence_parallel)
        if cfg.parallel.ep > 1:
            from meshrun.parallel.experts import check_experts_split

            check_experts_split(model, cfg.parallel.ep)
        check_weights(model)  # pretrained weights: present, shaped as the config says
        if reads_in_place(cfg) or is_prepared(data_dir(cfg)):
            check_data_fits(cfg, data_dir(cfg))
            check_packs_documents(cfg, model)
    if cfg.model.lora is not None:  # after the weights' checks: an adapter renames the layer it wraps
        check_lora(cfg.model.lora, model, tp=cfg.parallel.tp)
        if scope == "job" and cfg.parallel.pp > 1:
            check_lora_stages(cfg, model)
    return model


def check_packs_documents(cfg: Config, model: nn.Module) -> None:
    """Documents data trains only a model that keeps the documents of a row apart (or one a row,
    where its padding tail must still not be attended to): the model protocol's takes_documents;
    not under train.compile true, whose one graph per block the attention's per-document slices
    (read on the host, models/documents.py) break."""
    from meshrun.data.storage import DOCUMENTS_FORMAT, read_meta
    from meshrun.models.protocol import takes_documents

    meta = None if cfg.data.mixture or cfg.data.format != "meshrun" else read_meta(data_dir(cfg))
    if meta is None or meta.get("format") != DOCUMENTS_FORMAT:
        return
    if cfg.train.compile is True:
        raise ConfigError(
            f"train.compile true compiles each block as one graph, which attention within each document of "
            f"{data_dir(cfg)} breaks; set train.compile: auto (such blocks run eager) or false"
        )
    if takes_documents(model):
        return
    raise ConfigError(
        f"{data_dir(cfg)} holds documents with a loss mask, trained as packed rows whose documents attend only to "
        f"themselves, but model {cfg.model.name} does not take packed rows (the model protocol's takes_documents); "
        "use the built-in gpt or a Hugging Face decoder, or prepare the data as text"
    )


def check_lora(lora: LoraSection, model: nn.Module, *, tp: int) -> None:
    """model.lora's targets exist in the (whole) model and are linear layers that tp (> 1) can
    split with their adapters; then the adapters are added (meta device): the model returned names
    the tensors a LoRA run's checkpoints hold (what resume and export compare against)."""
    from meshrun.models.lora import add_adapters, check_targets

    check_targets(model, lora)
    add_adapters(model, lora, seed=None)
    if tp > 1 and lora.dropout > 0:  # the adapter's input is a row-parallel layer's shard: whose mask?
        raise ConfigError("model.lora.dropout under parallel.tp > 1 is not built yet: set model.lora.dropout=0")
    if tp > 1:
        from meshrun.parallel.tensor import check_adapters_split

        check_adapters_split(model)


def check_lora_stages(cfg: Config, model: nn.Module) -> None:
    """Every pipeline stage holds an adapter (`model`: whole, adapters added): a stage with nothing to
    train has no gradient to reduce or step, which DDP and the optimizer refuse deep in a worker. A
    stage holds its blocks, the first also `embed`, the last `norm` and `head` (the protocol's
    keep_stage); a split measured at start (parallel.balance) is not known yet: every block must."""
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    blocks = {int(name.split(".")[1]) for name in trainable if name.startswith("blocks.")}
    ends = {name.split(".")[0] for name in trainable if not name.startswith("blocks.")}  # e.g. an untied head
    split = static_split(cfg)
    stages = split if split is not None else [[i] for i in range(num_layers(cfg.model))]
    for n, layers in enumerate(stages):
        held = {"embed"} if n == 0 else set()
        held |= {"norm", "head"} if n == len(stages) - 1 else set()
        if blocks.isdisjoint(layers) and (split is None or not ends & held):
            where = f"pipeline stage {n} (blocks {layers[0]}-{layers[-1]})" if split else f"block {layers[0]}"
            raise ConfigError(
                f"model.lora.target_modules: {where} holds no module they name, and under parallel.pp a stage with "
                "nothing to train cannot run; name modules every block has (e.g. q_proj, v_proj), or set parallel.pp=1"
            )


def check_job(cfg: Config) -> None:
    """Every torch-free check of a training job (`train`, with or without --dry-run, and `slurm`)."""
    check_worker_env(cfg)
    prepares_data = not reads_in_place(cfg) and not is_prepared(data_dir(cfg))
    check_extras(cfg, prepares_data=prepares_data)
    hf_dir(cfg.model)  # model.hf: a local folder with a config.json (reading it needs no torch)
    check_model_size(cfg)  # whole, positive sizes a rank can hold: arithmetic, before any model exists
    validate_layout(cfg)  # blocks and microbatches over pipeline stages: needs the model's depth
    check_run_dir(cfg)
    check_writable(Path(cfg.run_dir))
    check_data_source(cfg)
    if prepares_data:  # the job writes its dataset there before training
        check_writable(data_dir(cfg), "data.dir" if cfg.data.dir is not None else "the data cache (XDG_CACHE_HOME)")
    check_observability(cfg)
    for path in [Path(source.dir) for source in cfg.data.mixture] or [data_dir(cfg)]:
        check_readable(path)


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "shared", "run")  # what wandb's settings accept


def check_observability(cfg: Config) -> None:
    """A WANDB_MODE wandb would refuse in every worker (it wins over tracker.mode, and wandb reads
    it even when meshrun disables the tracker). (The tensorboard package: extras.check_extras.)"""
    mode = os.environ.get("WANDB_MODE")
    if mode and mode not in WANDB_MODES:
        raise ConfigError(
            f"WANDB_MODE={mode!r} is not a wandb mode; set it to online, offline or disabled (lowercase), or unset it"
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
            f"{took}, but its world size {world} does not match {cfg.layout.axes_text()} = "
            f"{cfg.layout.degrees_text()}; launch {cfg.world_size} processes, change parallel.dp / parallel.pp, or {advice}"
        )
    rank = os.environ["RANK"]
    if not rank.isdigit() or int(rank) >= int(world):
        raise ConfigError(f"{took}, but RANK={rank!r} is not a rank below WORLD_SIZE={world}; {advice}")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(
            f"{took}, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set "
            f"(torchrun sets them); {advice}"
        )
    for name, problem in (("MASTER_ADDR", host_problem), ("MASTER_PORT", port_problem)):
        if said := problem(os.environ[name]):
            raise ConfigError(f"{took}, but {name}={os.environ[name]!r} {said}; {advice}")
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name)
        if value is not None and not value.isdigit():
            raise ConfigError(f"{took}, but {name}={value!r} is not a number; {advice}")
    check_resolves(os.environ["MASTER_ADDR"], f"{took}, but MASTER_ADDR")


def check_resolves(host: str, named: str) -> None:
    """A host name the rendezvous would retry for minutes (c10d warnings, then a timeout) if it
    does not resolve: refused in one line before torchrun starts."""
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"{named} {host!r} does not resolve ({reason}); use a host name or address this node can reach"
        ) from None


def check_rendezvous(cfg: Config) -> None:
    """The launcher's addresses resolve: the rendezvous host and this node's --local-addr (by
    `meshrun train` itself, not its --dry-run, which may plan a job for another network). Not
    the host on a node told it is a guest (--no-host-node, --node-rank > 0): it may start before
    the host's name is published (Kubernetes DNS), and launch.rdzv_timeout bounds its wait."""
    launch = cfg.launch
    if in_launched_worker():
        return
    if launch.rdzv_endpoint is not None and launch.host_node is not False:
        check_resolves(split_endpoint(launch.rdzv_endpoint)[0], "launch.rdzv_endpoint (--rdzv-endpoint) host")
    if launch.local_addr is not None:
        check_resolves(launch.local_addr, "launch.local_addr (--local-addr)")


RUN_FILES = ("metrics.jsonl", "summary.json", "outcome.json", "checkpoints", "loss.png", "pipeline_timeline.png")


def check_run_dir(cfg: Config) -> None:
    """The run directory is new, or holds a meshrun run to continue (same model, data and training:
    meshrun.launcher.rerun)."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir {cfg.run_dir} is a file, not a folder; set run_dir to a new folder")
    existing = run_dir / "config.json"
    ours = sorted(name for name in RUN_FILES if (run_dir / name).exists()) if run_dir.is_dir() else []
    if ours and not existing.exists():  # a run rewrites or deletes these: they are someone else's
        raise ConfigError(
            f"run_dir {cfg.run_dir} already holds {', '.join(ours)} but no meshrun config.json, so they are not a "
            "meshrun run's and would be overwritten; set run_dir to a new folder"
        )
    if existing.exists():
        if cfg.train.resume == "none":
            raise ConfigError(
                f"run_dir {cfg.run_dir} already holds a run; set train.resume=auto to continue it, or a new run_dir"
            )
        earlier = check_same_model(existing, cfg)
        check_not_mixed(run_dir, earlier.train.resume, cfg.train.resume)
        check_rerun(run_dir, earlier, cfg)
    if cfg.train.resume not in ("auto", "none") and not (Path(cfg.train.resume) / "manifest.json").is_file():
        raise ConfigError(f"train.resume {cfg.train.resume} is not a complete checkpoint folder (no manifest.json)")


def check_not_mixed(run_dir: Path, before: str, resume: str) -> None:
    """Another run's checkpoint goes into a new run_dir: loaded into one that holds a run, the
    metrics and checkpoints of two runs would interleave (and the later rows be dropped)."""
    if resume in ("auto", "none"):
        return
    start = Path(resume).resolve()
    own = checkpoint_root(run_dir).resolve()
    continuing = before not in ("auto", "none") and Path(before).resolve() == start  # a rerun of that command
    has_run = (run_dir / "metrics.jsonl").is_file() or bool(complete_checkpoints(run_dir))
    if has_run and not continuing and not start.is_relative_to(own):
        raise ConfigError(
            f"run_dir {run_dir} already holds a run, and train.resume {resume} is a checkpoint of another run: "
            "loading it here would mix the two runs' metrics and checkpoints; set a new run_dir to start from it "
            "(or train.resume=auto to continue this run)"
        )


def check_same_model(existing: Path, cfg: Config) -> Config:
    """A run directory continues only a meshrun run of the same model (any dp x pp layout); returns
    the earlier run's config."""
    try:
        earlier = Config.model_validate(read_json(existing))
        before = earlier.model
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
    then, now = data_tokenizer(earlier), data_tokenizer(cfg)
    if then and now and then["sha256"] != now["sha256"]:
        raise ConfigError(
            f"run_dir {cfg.run_dir} holds a run trained on data tokenized with {then['name']}, but this data was "
            f"tokenized with {now['name']}: its ids mean other words to the model; use the same tokenizer or a new run_dir"
        )
    return earlier


def data_tokenizer(cfg: Config) -> dict | None:
    """The tokenizer (name, sha256) the config's training data records, when its folder is there."""
    from meshrun.data.storage import read_meta

    with contextlib.suppress(ConfigError, OSError):
        meta = read_meta(training_data_dir(cfg))
        return meta.get("tokenizer") if meta else None
    return None


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
    if cfg.task == "regression" and cfg.data.sources and not is_prepared(path):
        raise ConfigError(
            "task regression does not prepare data.sources on first use: run `meshrun prepare-data --task regression "
            f"--source ... --seq-len {cfg.model.seq_len} --horizon {cfg.task_options.horizon} --out DIR` and set data.dir: DIR"
        )
    if cfg.task == "regression" and cfg.data.dir is not None and not is_prepared(path):
        raise ConfigError(
            f"task regression reads prepared series, and {path} holds none: run `meshrun prepare-data --task regression "
            f"--seq-len {cfg.model.seq_len} --horizon {cfg.task_options.horizon} --out DIR` and set data.dir: DIR "
            "(leave data.dir and data.sources out to train on the generated example series)"
        )
    if cfg.data.dir is not None and not cfg.data.sources and not is_prepared(path):
        task = " --task masked_lm" if cfg.task == "masked_lm" else ""
        raise ConfigError(
            f"data.dir {path} holds no prepared dataset; run `meshrun prepare-data{task} --out {path}` or set data.sources"
        )
    tokenizer = cfg.data.tokenizer or "byte"
    named_file = tokenizer != "byte" and not tokenizer.startswith("bpe:")
    if named_file and not is_prepared(path) and not Path(tokenizer).exists():
        raise ConfigError(
            f"data.tokenizer {tokenizer} does not exist; give a tokenizer.json or a model folder, byte, or bpe:VOCAB"
        )


def check_data_fits(cfg: Config, path: Path) -> None:
    """The data is what the job's task reads, parses, and fits the model (each task's own check)."""
    from meshrun.tasks import task_for  # imports torch

    task_for(cfg.task).check_data(cfg, path)
