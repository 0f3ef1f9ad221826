"""The one config mechanism: a typed schema, YAML files, dotted overrides and validation.

Every error a user can fix is raised as `ConfigError` with one line that names the key;
the CLI turns it into exit code 2 before any worker exists.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from meshrun.config.context import check_context_split, unsupported
from meshrun.config.fields import Float, Int, PathText, Section, is_text, lowercase
from meshrun.config.model_sections import SECTIONS, EncoderSection, GPTSection, HFSection, ModelConfig, route_model
from meshrun.config.safe_yaml import parse_document, read_config_file
from meshrun.config.tasks import TaskName, TaskOptions, check_task, default_task
from meshrun.config.topology import LaunchConfig, ParallelConfig, check_layout, peer_recovery
from meshrun.errors import ConfigError
from meshrun.parallel.layout import Layout

Beta = Annotated[Float, Field(ge=0.0, lt=1.0)]
Precision = Annotated[Literal["auto", "fp32", "bf16", "fp16"], BeforeValidator(lowercase)]
TrackerMode = Annotated[Literal["online", "offline", "disabled"], BeforeValidator(lowercase)]
Backend = Annotated[Literal["wandb", "tensorboard", "jsonl"], BeforeValidator(lowercase)]
_RECOMPUTE = re.compile(r"^(none|full|selective|every:[1-9][0-9]*)$")
_EVERY = re.compile(r"^every:[1-9][0-9]*$")
# words meaning "off" that users write for a mode, mapped to the choice that means it
_OFF_WORDS = {"off": "disabled", "no": "disabled", "false": "disabled", "none": "disabled"}


DataFormat = Literal["meshrun", "nanogpt", "nanogpt-uint32", "megatron"]


def bpe_vocab(spec_text: str, *, key: str) -> int:
    """The VOCAB of a `bpe:VOCAB` setting; `key` names where it was set (flag or config key)."""
    kind, _, vocab = spec_text.partition(":")
    if kind != "bpe" or not vocab.isdigit() or int(vocab) < 257:
        raise ConfigError(f"{key} {spec_text!r}: use bpe:VOCAB with VOCAB >= 257 (256 bytes + end of text)")
    return int(vocab)


class MixtureSource(Section):
    dir: PathText
    """A dataset folder (or, for megatron, a PREFIX of PREFIX.bin + PREFIX.idx)."""
    weight: Float = Field(gt=0.0)
    """Relative share of samples drawn from this source."""
    format: DataFormat = "meshrun"
    """How this source is stored (see data.format)."""


class DataConfig(Section):
    dir: PathText | None = None
    """Dataset folder from `meshrun prepare-data` (or see `format`); None = a cache folder for the embedded corpus."""
    format: DataFormat = "meshrun"
    """meshrun (prepare-data), nanogpt (uint16 train.bin / val.bin, vocab = model.vocab_size), nanogpt-uint32 (the same in uint32, for vocabularies over 65536), megatron (PREFIX.bin + PREFIX.idx)."""
    mixture: list[MixtureSource] = []
    """Datasets sampled by weight, e.g. [{dir: A, weight: 0.7}, {dir: B, weight: 0.3}]; used instead of `dir`."""
    sources: list[PathText] = []
    """Files or globs to prepare when `dir` is empty (task classification: tables with `text` and `label` fields); empty = the built-in example (the standard library's .py files, or its docstrings labelled by package)."""
    tokenizer: PathText | None = None
    """Tokenizer for data `meshrun train` prepares itself (no data.dir, or an empty one): byte (None), bpe:VOCAB (trained on the sources), or a tokenizer.json / model folder."""
    val_fraction: Float = Field(default=0.05, gt=0.0, lt=0.5)
    """Share of documents held out for validation (prepare; and the tail of a Megatron dataset)."""
    pairs: bool = False
    """Prepare `sources` as seq2seq text pairs (one .jsonl with source/target fields, or two aligned text files); no sources = the built-in example."""
    packing: bool | None = None
    """Documents data (prepare-data --chat / --prompt-completion): pack whole documents into rows of model.seq_len, each attending only to itself (true; None means true for such data), or pad each document alone to model.seq_len (false). Other data: leave unset."""
    buckets: list[Int] = []
    """Pairs data: padded sample lengths (e.g. [16, 32]; model.seq_len is always one); each global batch comes from one bucket, padded to its length. Empty = every batch padded to model.seq_len."""

    @model_validator(mode="after")
    def _dir_or_mixture(self) -> DataConfig:
        """data.dir or data.mixture, not both; a format other than meshrun and data.sources need data.dir; data.tokenizer bpe:VOCAB has VOCAB >= 257."""
        if self.mixture and self.dir is not None:
            raise ValueError("set data.dir or data.mixture, not both")
        if self.format != "meshrun" and self.dir is None and not self.mixture:
            raise ValueError(f"data.format {self.format} reads existing files: set data.dir to them")
        if self.sources and self.dir is None:
            raise ValueError("data.sources needs data.dir: the folder to prepare them into")
        if self.tokenizer and self.tokenizer.startswith("bpe"):
            bpe_vocab(self.tokenizer, key="data.tokenizer")
        return self


class TrainConfig(Section):
    global_batch: Int = Field(default=8, ge=1)
    """Samples per optimizer step, summed over all data-parallel ranks and micro-steps."""
    micro_batch: Int = Field(default=2, ge=1)
    """Samples per forward/backward on one rank; accumulation = global_batch / (micro_batch * dp)."""
    steps: Int = Field(default=50, ge=1)
    """Optimizer steps to run."""
    optimizer: Annotated[Literal["adamw", "adam", "sgd", "rmsprop"], BeforeValidator(lowercase)] = "adamw"
    """The torch.optim class that updates the weights: adamw (decoupled weight decay), adam, sgd or rmsprop."""
    lr: Float = Field(default=1e-3, gt=0.0)
    """Peak learning rate (of whichever optimizer)."""
    min_lr_ratio: Float = Field(default=0.1, ge=0.0, le=1.0)
    """Cosine decay floor as a fraction of `lr`."""
    warmup_steps: Int = Field(default=5, ge=0)
    """Linear warmup steps before cosine decay."""
    weight_decay: Float = Field(default=0.1, ge=0.0)
    """Weight decay of matrices (not norms and biases): decoupled for adamw; for adam, sgd and rmsprop added to the
    gradient (L2), as their torch.optim classes do."""
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    """adamw and adam: betas (beta1, beta2), each in [0, 1)."""
    eps: Float = Field(default=1e-8, gt=0.0)
    """adamw, adam and rmsprop: the term added to the denominator (torch.optim's `eps`)."""
    momentum: Float = Field(default=0.0, ge=0.0, lt=1.0)
    """sgd and rmsprop: momentum factor in [0, 1) (0: none)."""
    nesterov: bool = False
    """sgd: Nesterov momentum (needs momentum > 0)."""
    alpha: Float = Field(default=0.99, gt=0.0, lt=1.0)
    """rmsprop: smoothing constant of the squared-gradient average, in (0, 1)."""
    grad_clip: Float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    eval_interval: Int = Field(default=25, ge=0)
    """Run validation every N steps and at the end; 0 disables validation."""
    eval_batches: Int = Field(default=2, ge=1)
    """Global batches of validation data per evaluation."""
    log_interval: Int = Field(default=5, ge=1)
    """Log metrics every N steps."""
    seed: Int = 1337
    """Seed for weights (per layer, so any layout starts identical) and data order."""
    compile: Annotated[Literal["auto", True, False], BeforeValidator(lowercase)] = "auto"
    """torch.compile each Transformer block: auto (on CUDA; off on CPU, where compiling outlasts short jobs), true (a block that cannot compile stops the run), false (eager)."""
    offload_activations: bool | str = False
    """Keep the activations whole blocks save for backward in host memory until it (torch's save_on_cpu, pinned on CUDA): true (every block), every:N (every Nth block) or false; a block the recompute policy selects is recomputed, not offloaded."""
    resume: PathText = "auto"
    """auto: continue from the run directory's newest complete checkpoint; none: refuse an existing run; or a
    checkpoint path to start from (a rerun of the same config continues from the checkpoints saved since)."""

    @field_validator("offload_activations")
    @classmethod
    def _offload_policy(cls, value: bool | str) -> bool | str:
        """true, false or every:N with N >= 1 (any case)."""
        if isinstance(value, bool):
            return value
        value = value.lower()
        if value in ("true", "false"):
            return value == "true"
        if not _EVERY.match(value):
            raise ValueError(f"use true, false or every:N with N >= 1 (got {value!r})")
        return value

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, value: Any) -> Any:
        """Exactly two numbers [beta1, beta2], each in [0, 1)."""
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"give two numbers [beta1, beta2], each in [0, 1), e.g. [0.9, 0.95] (got {value!r})")
        return value

    @model_validator(mode="after")
    def _options_of_the_optimizer(self) -> TrainConfig:
        """An option the chosen optimizer does not take is refused when set away from its default, not ignored."""
        for key, takes in OPTIMIZER_OPTIONS.items():
            if self.optimizer not in takes and getattr(self, key) != TrainConfig.model_fields[key].default:
                raise ValueError(
                    f"train.{key} is an option of {' and '.join(takes)}, not of train.optimizer {self.optimizer}; "
                    f"remove it or choose one of those optimizers"
                )
        if self.nesterov and self.momentum == 0:
            raise ValueError("train.nesterov needs train.momentum > 0 (e.g. --set train.momentum=0.9)")
        return self

    def optimizer_state(self) -> tuple[int, int]:
        """What the optimizer keeps: (fp32 values per trainable parameter value, bytes per parameter tensor).

        adamw and adam keep two moments, rmsprop the squared-gradient average (and a momentum buffer when
        momentum > 0), sgd a momentum buffer when momentum > 0; all but sgd count steps in a float32 scalar
        per tensor. The planner, --dry-run and the k8s manifest's checkpoint size read it."""
        per_value = {"adamw": 2, "adam": 2, "rmsprop": 1 + (self.momentum > 0), "sgd": int(self.momentum > 0)}
        return per_value[self.optimizer], 0 if self.optimizer == "sgd" else 4


# The options that are not every optimizer's, and which optimizers take them (TrainConfig refuses the rest).
OPTIMIZER_OPTIONS = {
    "betas": ("adamw", "adam"),
    "eps": ("adamw", "adam", "rmsprop"),
    "momentum": ("sgd", "rmsprop"),
    "nesterov": ("sgd",),
    "alpha": ("rmsprop",),
}


class CheckpointConfig(Section):
    interval: Int = Field(default=0, ge=0)
    """Save a checkpoint every N steps (0: only at the end); saves are atomic."""
    keep: Int = Field(default=3, ge=1)
    """Keep the newest K complete checkpoints."""
    at_end: bool = True
    """Save a checkpoint when training finishes."""
    async_: bool = Field(default=False, alias="async")
    """Interval and SAVE saves block only while the state is copied, written in the background (costs a host copy)."""

    # `async` is a Python keyword: the field is `async_`, its key `async`, in files and --set alike
    model_config = Section.model_config | ConfigDict(validate_by_name=False, serialize_by_alias=True)


class AmpConfig(Section):
    init_scale: Float = Field(default=2.0**16, gt=0.0)
    """fp16 GradScaler initial loss scale."""
    growth_interval: Int = Field(default=2000, ge=1)
    """fp16 GradScaler: steps without overflow before the scale grows."""


class TrackerConfig(Section):
    mode: TrackerMode = "offline"
    """wandb mode; `online` without an API key falls back to offline. WANDB_MODE overrides it."""
    project: str = "meshrun"
    """wandb project."""
    name: str | None = None
    """wandb run name; None = the run directory's name."""
    entity: str | None = None
    """wandb entity (team or user)."""
    init_timeout: Float = Field(default=15.0, gt=0)
    """Seconds `online` waits for the wandb server before logging offline instead (WANDB_INIT_TIMEOUT wins)."""
    backends: list[Backend] = ["wandb", "jsonl"]
    """Where metric rows go: any of wandb, tensorboard (RUN_DIR/tensorboard), jsonl (RUN_DIR/metrics.jsonl)."""

    @field_validator("backends")
    @classmethod
    def _backends_once(cls, value: list[str]) -> list[str]:
        """Each backend named once (a row logged twice would count twice)."""
        if len(set(value)) != len(value):
            raise ValueError(f"name each backend once (got {value})")
        return value


class MetricsConfig(Section):
    peak_tflops: Float | None = Field(default=None, gt=0.0)
    """Peak TFLOP/s of one device for MFU; None = look the GPU up in a table (unknown on CPU)."""
    plots: bool = True
    """Draw loss.png and pipeline_timeline.png into run_dir at the end (rank 0, matplotlib: ~1 s)."""
    straggler_ratio: Float = Field(default=1.2, gt=1.0)
    """A log window where one rank's compute time (its waits excluded) is this many times the median rank's is slow."""
    straggler_windows: Int = Field(default=3, ge=1)
    """The slowest rank of this many slow log windows in a row is named in one warning line (once per rank)."""


class ProfileConfig(Section):
    steps: list[Annotated[Int, Field(ge=1)]] = []
    """Optimizer steps (1-based, as logged) to trace with torch.profiler into RUN_DIR/profile/, e.g. [5, 6]."""
    ranks: list[Annotated[Int, Field(ge=0)]] | None = None
    """Global ranks that write traces; None = every rank."""
    memory_snapshot: bool = False
    """CUDA: also write torch.cuda.memory snapshots (pickle for pytorch.org/memory_viz) at `steps`."""

    @model_validator(mode="after")
    def _snapshot_needs_steps(self) -> ProfileConfig:
        """profile.memory_snapshot needs profile.steps: the steps to snapshot."""
        if self.memory_snapshot and not self.steps:
            raise ValueError("profile.memory_snapshot needs profile.steps (the steps to snapshot), e.g. [5]")
        return self


class Config(Section):
    model: ModelConfig = GPTSection()
    data: DataConfig = DataConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    # -- the job's objective (config/tasks.py) --
    task: TaskName = "causal_lm"
    """What the model learns: causal_lm (next token), seq2seq (source -> target pairs; the default with data.pairs
    or model.name encdec), classification (text -> label), regression (numeric series -> next values), masked_lm
    (masked tokens); `meshrun prepare-data --task` prepares each task's data."""
    task_options: TaskOptions = TaskOptions()
    """Options of the chosen task (each names its task)."""

    @model_validator(mode="before")
    @classmethod
    def _default_task(cls, data: Any) -> Any:
        """An unnamed task is seq2seq with data.pairs or an encoder-decoder model, else causal_lm."""
        return default_task(data)

    @model_validator(mode="after")
    def _task_fits(self) -> Config:
        """data.pairs and model.name encdec go with task seq2seq; a task_options key set for another task is refused."""
        head = self.model.head if isinstance(self.model, EncoderSection) else None
        labels = self.model.num_labels if isinstance(self.model, HFSection) else None
        check_task(
            self.task,
            pairs=self.data.pairs,
            model_name=self.model.name,
            options=self.task_options,
            encoder_head=head,
            hf_num_labels=labels,
        )
        return self

    # -- end of the objective --
    precision: Precision = "auto"
    """Autocast dtype: auto (bf16 where the hardware has it, fp16 on older GPUs, else fp32), fp32 (off), bf16, fp16 (GradScaler)."""
    amp: AmpConfig = AmpConfig()
    recompute: str = "none"
    """Activation recompute: none | full | every:N (every Nth block) | selective (keep matmul outputs)."""
    tracker: TrackerConfig = TrackerConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig = ProfileConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()
    run_dir: PathText = "runs/default"
    """Where config.json, metrics.jsonl, plots (and later checkpoints) go."""

    @model_validator(mode="before")
    @classmethod
    def _model_family(cls, data: Any) -> Any:
        """The model keys routed to their family's section (see config/model_sections.py)."""
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            return {**data, "model": route_model(data["model"])}
        return data

    @field_validator("recompute")
    @classmethod
    def _recompute_policy(cls, value: str) -> str:
        """One of none, full, selective, every:N with N >= 1 (any case)."""
        value = value.lower()
        if not _RECOMPUTE.match(value):
            raise ValueError(f"use one of none, full, selective, every:N with N >= 1 (got {value!r})")
        return value

    @model_validator(mode="after")
    def _offload_leaves_a_block(self) -> Config:
        """train.offload_activations with a recompute policy that leaves some block not recomputed
        (a block is either recomputed or offloaded)."""
        if self.train.offload_activations is not False and self.recompute in ("full", "selective", "every:1"):
            raise ConfigError(
                f"train.offload_activations offloads no block: recompute {self.recompute} recomputes every block; "
                "set recompute to none or every:N (N >= 2), or remove train.offload_activations"
            )
        return self

    @field_validator("run_dir")
    @classmethod
    def _run_dir_named(cls, value: str) -> str:
        """Not empty: an empty run_dir would write into the current directory."""
        if not value.strip():
            raise ValueError("is empty, which would write into the current directory; name a folder, e.g. runs/my-job")
        return value

    @model_validator(mode="after")
    def _moe_layout(self) -> Config:
        """model.moe.aux_loss microbatch pools every MoE layer of a microbatch: parallel.pp 1 (one stage holds
        them all)."""
        moe = getattr(self.model, "moe", None)
        if moe is not None and moe.aux_loss == "microbatch" and self.parallel.pp > 1:
            raise ConfigError(
                f"model.moe.aux_loss microbatch pools every MoE layer of a microbatch, which parallel.pp {self.parallel.pp} "
                "splits over stages; use model.moe.aux_loss=sequence (layout-independent) or parallel.pp=1"
            )
        return self

    @model_validator(mode="after")
    def _layout_runs(self) -> Config:
        """The layout runs: train.global_batch a multiple of micro_batch x dp; the world size split evenly over
        launch.nnodes with each tp group on one node; the heads (and, under sequence parallel, the sequence
        lengths) divisible by tp; profile.ranks and profile.steps that exist."""
        check_layout(  # the batch over ranks, workers over nodes, profiled ranks that exist
            self.parallel,
            self.launch,
            global_batch=self.train.global_batch,
            micro_batch=self.train.micro_batch,
            profiled_ranks=self.profile.ranks or [],
            tp_splits=self.model.tp_splits(),
            sequences=self.model.sequence_splits(self.data.buckets),
        )
        self._context_splits()
        if self.precision == "fp16" and peer_recovery(self.parallel, self.launch):  # its scaler's group is not rebuilt
            raise ConfigError(
                "launch.recovery peer does not run fp16 so far; use precision bf16 or fp32, or recovery checkpoint"
            )
        late = [step for step in self.profile.steps if step > self.train.steps]
        if late:
            raise ConfigError(
                f"profile.steps {late} come after the last step (train.steps is {self.train.steps}): "
                "no trace would be written; profile earlier steps"
            )
        return self

    def _context_splits(self) -> None:
        """parallel.cp: a family and task it runs, heads and lengths it divides (config/context.py;
        a Hugging Face model's heads, read from its config.json, in preflight); not with
        train.compile true, whose one graph per block the all-to-alls break."""
        if self.parallel.cp > 1 and self.train.compile is True:
            raise ConfigError(
                f"train.compile true compiles each block as one graph, which parallel.cp {self.parallel.cp}'s "
                "all-to-alls break; set train.compile: auto (such blocks run eager) or false"
            )
        check_context_split(
            self.parallel,
            refused=unsupported(self.model.family, self.task),
            heads=self.model.tp_splits() if self.model.family == "gpt" else {},
            sequences=self.model.sequence_splits(self.data.buckets),
        )

    @property
    def layout(self) -> Layout:
        """The parallel layout: axes, degrees, ranks and stages (meshrun.parallel.layout)."""
        return Layout.of(self.parallel)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per optimizer step on one rank (= pipeline microbatches when pp > 1)."""
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch * self.model.seq_len

    @property
    def nproc_per_node(self) -> int:
        """Workers each torchrun agent starts."""
        return self.launch.nproc_per_node or self.world_size // self.launch.nnodes


def default_config_text() -> str:
    return resources.files("meshrun").joinpath("configs/default.yaml").read_text()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """YAML file (or the packaged default) + `key.path=value` overrides -> validated Config."""
    if path is None:
        text, where = default_config_text(), "default config"
    else:
        text, where = read_config_file(path), f"config file {path}"
    data = parse_document(text, where)
    if data is None:  # refused rather than silently training the built-in defaults
        raise ConfigError(
            f"{where} is empty (no keys); write at least one section (e.g. train:), "
            "or leave out the file to use the packaged default"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a YAML mapping of sections (model:, train:, ...)")
    for item in overrides:
        _apply_override(data, item)
    return validate(data)


def validate(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc.errors()[0])) from None


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r} must look like key.path=value (for example train.lr=3e-4)")
    node = data
    *parents, leaf = key.strip().split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
        node = child
    try:
        text.encode()
    except UnicodeEncodeError:  # a non-UTF-8 byte from the shell, e.g. a latin-1 path
        raise ConfigError(f"--set {key}: the value is not valid UTF-8 text; give it in UTF-8") from None
    try:
        value = parse_document(text, f"--set {key}") if text.strip() else None
    except ConfigError:
        value = text  # not YAML (e.g. `a: b: c`): the text itself, validated as such
    if isinstance(value, (dict, bool)) and _is_text_key([*parents, leaf]):
        value = text.strip()  # a key typed as text takes the text: `launch.rdzv_endpoint=localhost:` is no mapping
    node[leaf] = _merged(node.get(leaf), value)


def _is_text_key(dotted: list[str]) -> bool:
    owners = [s.family for s in SECTIONS.values() if dotted[-1] in s.model_fields]  # a model key: its family's
    section = _section_at(dotted[:-1], family=owners[0] if owners else None)
    field = section.model_fields.get(dotted[-1]) if section else None
    return field is not None and is_text(field.annotation)


def _merged(old: Any, new: Any) -> Any:
    """A mapping set onto a mapping sets its keys (`--set "model={dim: 64}"` keeps the other model
    keys, as `--set model.dim=64` does); any other value replaces the old one."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return new


def _explain(error: ErrorDetails) -> str:
    """One pydantic error -> one line in config words (dotted keys, no class names)."""
    loc = list(error["loc"])
    family = loc.pop(1) if loc[:1] == ["model"] and len(loc) > 1 and loc[1] in SECTIONS else None  # a tag, no key
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "config"
    got = json.dumps(error.get("input"), default=str)
    if error["type"] == "extra_forbidden":
        parent = [str(p) for p in loc[:-1]]
        section = _section_at(parent, family=family)
        known = [field.alias or name for name, field in section.model_fields.items()] if section else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join(parent + close)}?" if close else f"known keys: {', '.join(known)}"
        return f"unknown config key {key}: {hint}"
    if error["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"invalid {key}: expected a section of keys (a YAML mapping, e.g. {key}: {{...}}) (got {got})"
    if error["type"] == "literal_error":  # choices in YAML's words: true, not Python's True
        choices = re.sub(r"\b(True|False)\b", lambda m: m[1].lower(), error["msg"].removeprefix("Input should be "))
        return f"invalid {key}: use {choices} (got {got}){_suggest(error)}"
    if error.get("input", "") is None and error["type"].endswith("_type"):  # `--set run_dir=` reads as null
        return f"invalid {key}: no value given (empty or null); set one, or leave the key out for its default"
    message = error["msg"].removeprefix("Value error, ")
    if not loc and error["type"] == "value_error":  # a rule over several sections names its keys itself
        return message
    if error["type"].startswith("value_error") or error["type"] == "assertion_error":
        return f"invalid {key}: {message}"
    return f"invalid {key}: {message} (got {got})"


def _suggest(error: ErrorDetails) -> str:
    """' ; did you mean X?' for a misspelt choice (`off` for a mode means `disabled`)."""
    choices = re.findall(r"'([^']*)'", error.get("ctx", {}).get("expected", ""))
    given = str(error.get("input")).lower()
    close = [_OFF_WORDS[given]] if _OFF_WORDS.get(given) in choices else difflib.get_close_matches(given, choices, n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _section_at(loc: list[str], *, family: Any = None) -> type[BaseModel] | None:
    """The section class at dotted `loc`; `model` is the section of `family` (default: gpt)."""
    if loc == ["model"]:
        return SECTIONS.get(family, GPTSection) if isinstance(family, str) else GPTSection
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def check_code_trusted(cfg: Config, source: Path, *, trust_code: bool, instead: str = "") -> None:
    """The one rule for code named by files: a model.factory read from a file meshrun did not get
    on the command line (a run's or a checkpoint's config.json, written by whoever wrote the folder)
    is imported only under --trust-code. `instead`: another remedy the command offers."""
    if cfg.model.factory is not None and not trust_code:
        raise ConfigError(
            f"{source} names model.factory {cfg.model.factory!r}, code meshrun does not import on a file's word: "
            f"{instead}pass --trust-code to import it"
        )
