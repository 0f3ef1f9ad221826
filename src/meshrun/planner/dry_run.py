"""What `meshrun train --dry-run` prints: the resolved config, the model, the process layout, the
batch maths, each pipeline rank's training state and the precision, without starting a worker."""

from __future__ import annotations

import yaml
from torch import nn

from meshrun.config.schema import Config
from meshrun.hardware.device import local_device, rank_memory_bytes
from meshrun.hardware.precision import resolve_precision
from meshrun.models.families import init_line
from meshrun.models.hf_config import is_hf, load_hf_config
from meshrun.models.lora import parameter_counts
from meshrun.models.moe import inactive_params, sparse_mlps
from meshrun.models.task_io import task_io
from meshrun.parallel.stages import static_split


def describe_split(cfg: Config) -> list[str] | None:
    """Blocks held by each pipeline rank, for display (None: no pipeline, or measured at start)."""
    par = cfg.parallel
    split = static_split(cfg) if par.pp > 1 else None
    if split is None:
        return None
    return [" + ".join(str(split[s]) for s in cfg.layout.stages_of(rank)) for rank in range(par.pp)]


def describe_layout(cfg: Config) -> list[str]:
    """The rank order, the schedule's stages, and each pipeline rank's ranks, stages and blocks."""
    layout, par = cfg.layout, cfg.parallel
    lines = ["layout:", f"  {layout.grid()}"]
    if par.pp > 1:
        split_over = f", each split over its {par.tp} tp ranks" if par.tp > 1 else ""
        lines.append(
            f"  schedule {par.schedule}: {layout.num_stages} stages, {layout.per_rank} a pipeline rank{split_over}"
        )
    split = describe_split(cfg)
    for rank in range(par.pp):
        stages = f", stages {layout.stages_of(rank)}" if layout.per_rank > 1 else ""
        blocks = f", blocks {split[rank]}" if split else ""
        lines.append(f"  pipeline rank {rank}: ranks {layout.ranks_of_pp_rank(rank)}{stages}{blocks}")
    return lines


# keys of `model` a family does not read: a Hugging Face model takes them from its own
# config.json; a time series has no vocabulary
_UNREAD = {"hf": ("name", "num_layers", "dim", "num_heads", "vocab_size"), "timeseries": ("vocab_size",)}


def describe_experts(model: nn.Module) -> list[str]:
    """A Mixture-of-Experts model's MoE layers and its active parameters (those a token runs
    through: what MFU counts); nothing for a dense model."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict) or not (mlps := sparse_mlps(blocks)):
        return []
    gate = next(iter(mlps.values())).gate
    total = sum(p.numel() for p in model.parameters())
    active = total - inactive_params(blocks)
    layers = ", ".join(str(i) for i in mlps)
    line = f"  MoE: {len(mlps)} layers ({layers}), {gate.num_experts} experts each, top {gate.top_k}: "
    return [line + f"{active:,.0f} of the {total:,} parameters active per token (MFU counts these)"]


def describe_model(cfg: Config, model: nn.Module) -> list[str]:
    """The shape of the model that will train (a Hugging Face one's own, not the built-in
    defaults), its parameter count and where its weights come from."""
    if is_hf(cfg.model):
        hf = load_hf_config(cfg.model)
        source = f"{hf.model_type} from {cfg.model.hf or 'model.hf_config'}"
        shape = (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.vocab_size)
    else:
        source = cfg.model.factory or cfg.model.name
        shape = (cfg.model.num_layers, cfg.model.dim, cfg.model.num_heads, cfg.model.vocab_size)
    layers, dim, heads, vocab = shape
    reads = task_io(cfg, vocab=vocab).reads  # the task's: a vocabulary, labels, or a series' features
    trainable, params = parameter_counts(model)  # a tied matrix once; peft's count of trainable ones
    trained = f" ({trainable:,} trainable: the LoRA adapters)" if cfg.model.lora is not None else ""
    return [
        "model:",
        f"  {source}: {layers} blocks, dim {dim}, {heads} heads, {reads}, seq_len {cfg.model.seq_len}",
        f"  {params:,} parameters{trained}; {init_line(cfg, model)}",
        *describe_experts(model),
    ]


def describe_job(cfg: Config, model: nn.Module) -> str:
    """The resolved config, the model, the process layout and the batch maths (for --dry-run)."""
    from meshrun.parallel.experts import describe_expert_parallel
    from meshrun.parallel.fsdp import describe_data_parallel  # torch.distributed.fsdp: --dry-run only
    from meshrun.planner.layout_memory import rank_state_bytes

    par, train = cfg.parallel, cfg.train
    resolved = cfg.model_dump(mode="json")
    unread = _UNREAD.get(cfg.model.family, ())
    resolved["model"] = {k: v for k, v in resolved["model"].items() if k not in unread}
    lines = [yaml.safe_dump(resolved, sort_keys=False).rstrip(), "", *describe_layout(cfg)]
    lines += describe_model(cfg, model)
    lines += [
        "batch:",
        (
            f"  global batch {train.global_batch} samples = micro batch {train.micro_batch} x dp {par.dp} "
            f"x accumulation steps {cfg.accumulation_steps}"
        ),
        f"  tokens per step {cfg.tokens_per_step} (seq_len {cfg.model.seq_len})",
    ]
    lines += describe_data_parallel(cfg) + describe_expert_parallel(cfg.layout, model)
    states = rank_state_bytes(cfg) or []  # none when the split is measured at start
    lines += [
        f"  pipeline rank {r}: per rank params {_mib(s.params)} + grads {_mib(s.grads)} + "
        f"optimizer {_mib(s.optimizer)} = {_mib(s.params + s.grads + s.optimizer)}"
        for r, s in enumerate(states)
    ]
    lines += memory_warnings([s.params + s.grads + s.optimizer for s in states], *rank_memory_bytes(cfg.nproc_per_node))
    choice = resolve_precision(cfg.precision, local_device())
    lines += ["precision:", f"  {choice.reason}"] + ([f"  warning: {choice.warning}"] if choice.warning else [])
    return "\n".join(lines)


def memory_warnings(state_bytes: list[int], device_bytes: int, device: str) -> list[str]:
    """--dry-run lines for pipeline ranks whose training state (as printed above them) exceeds
    `device_bytes`, the memory one rank has here (`device` says which)."""
    return [
        f"  warning: pipeline rank {rank} needs ~{need / 2**30:.1f} GiB of training state per rank, more than "
        f"{device}; use more pipeline stages, parallel.dp_mode=fsdp or a smaller model"
        for rank, need in enumerate(state_bytes)
        if need > device_bytes
    ]


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"
