"""A model's size from its config alone: arithmetic on the numbers, nothing built, not even on
the meta device (a billion meta blocks took minutes and gigabytes before anything was refused).

`check_model_size` runs in preflight before any model exists: every size a Hugging Face
config.json (or `model.hf_config`) sets is a whole number >= 1, named in the model's own terms;
then the parameters of each pipeline rank are counted and a config no rank could hold is refused.
This is a bound for refusing impossible sizes, not the estimate --dry-run and the planner print
(`planner.layout_memory.rank_state_bytes`: exact bytes of the stages built on the meta device).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrun.config.model_sections import FactorySection, HFSection, ModelConfig
from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.files.json_reader import read_json
from meshrun.models.hf_config import hf_dir, load_hf_config
from meshrun.models.task_io import task_io

# Deepest published Transformer LMs have ~130 blocks (Llama 3.1 405B: 126). Even on the meta
# device each block is Python objects: 10,000 take ~6 s and ~300 MB to build on a 2-core machine,
# so far more is a typo that would hold a machine for minutes before anything could be refused.
MAX_BLOCKS = 10_000
# One rank's training state (+ one microbatch's logits). The largest accelerator meshrun knows
# (metrics/devices.py) holds 180 GiB (B200); a rank that offloads to its host shares that host's
# few TiB. 4 TiB on ONE rank is beyond any of them: such a config is a mistaken size, not a model,
# and would otherwise pass --dry-run and die allocating in a worker.
MAX_RANK_BYTES = 4 * 2**40
LOGIT_BYTES = 4  # the loss reads the last stage's fp32 output: (micro_batch, seq_len, vocab) logits of tokens
# Hugging Face config keys meshrun sizes a model with (llama-style names, and GPT-2's own).
HF_SIZE_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "n_layer",
    "n_embd",
    "n_inner",
    "n_head",
    "n_positions",
    "n_ctx",
)


@dataclass(frozen=True)
class ModelSize:
    """Parameters of the parts a pipeline stage may hold (estimates: small norms and biases aside)."""

    embed: int  # first stage
    block: int  # each block
    head: int  # last stage: final norm and output projection
    num_blocks: int
    vocab: int


def check_model_size(cfg: Config) -> None:
    """Refuse sizes that are not whole numbers >= 1, more blocks than MAX_BLOCKS, or a rank that
    would need more than MAX_RANK_BYTES; one line each, before any model is built."""
    model = cfg.model
    if isinstance(model, FactorySection):
        return  # a user's model: its size is its factory's business
    size = model_size(model)
    where = _where(model)
    if size.num_blocks > MAX_BLOCKS:
        raise ConfigError(
            f"{where}{_key(model, 'num_hidden_layers', 'model.num_layers')} is {size.num_blocks}, more blocks than "
            f"meshrun builds ({MAX_BLOCKS}); set the model's real depth"
        )
    per_rank = rank_bytes(cfg, size)
    need = max(per_rank)
    worst = per_rank.index(need)
    if need > MAX_RANK_BYTES:
        raise ConfigError(
            f"{where}this model has ~{total_params(size):.3g} parameters and pipeline rank {worst} would need "
            f"~{need / 2**30:,.0f} GiB (training state + one microbatch's logits), more than any device could hold "
            f"({MAX_RANK_BYTES // 2**40} TiB); check {_sizes_named(model)}"
        )


def model_size(model: ModelConfig) -> ModelSize:
    """The parameters of each part of the model the config describes, by arithmetic."""
    if not isinstance(model, HFSection):
        d, v = model.dim, model.vocab_size
        # encdec: every block priced as a decoder block (with cross-attention), an upper estimate
        block = 16 * d * d + 19 * d if model.name == "encdec" else 12 * d * d + 13 * d
        return ModelSize(
            embed=v * d + model.seq_len * d, block=block, head=v * d + 2 * d, num_blocks=model.num_layers, vocab=v
        )
    fields = hf_fields(model)
    layers, hidden, vocab = (
        _size(model, fields, names)
        for names in (("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd"), ("vocab_size",))
    )
    heads = _size(model, fields, ("num_attention_heads", "n_head"))
    tied = fields.get("tie_word_embeddings", fields.get("model_type") == "gpt2") is True
    if fields.get("model_type") == "gpt2":
        inner = fields.get("n_inner") or 4 * hidden
        positions = fields.get("n_positions") or fields.get("n_ctx") or 1024
        block = 4 * hidden * hidden + 2 * hidden * inner + 9 * hidden + inner
        return ModelSize(vocab * hidden + positions * hidden, block, 0 if tied else vocab * hidden, layers, vocab)
    head_dim = fields.get("head_dim") or hidden // heads
    kv_heads = fields.get("num_key_value_heads") or heads
    if heads % kv_heads:  # each key/value head serves a whole group of query heads (GQA)
        raise ConfigError(
            f"{_where(model)}{_key(model, 'num_key_value_heads')} ({kv_heads}) must divide num_attention_heads "
            f"({heads}); the attention would fail in every worker"
        )
    inner = _size(model, fields, ("intermediate_size",))
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    block = attention + 3 * hidden * inner + 2 * hidden
    return ModelSize(vocab * hidden, block, hidden + (0 if tied else vocab * hidden), layers, vocab)


def hf_fields(model: HFSection) -> dict[str, Any]:
    """The raw Hugging Face config (config.json or model.hf_config), every size checked to be a
    whole number >= 1 (None: transformers' default); read before transformers sees it."""
    if model.hf_config is not None:
        fields = dict(model.hf_config)
    else:
        path = hf_dir(model)
        assert path is not None  # model.hf is set
        fields = _read_config_json(path / "config.json", _where(model))
    for key in HF_SIZE_KEYS:
        value = fields.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{_where(model)}{_key(model, key)} is {json.dumps(value)}; it must be a whole number")
        if value < 1:
            raise ConfigError(f"{_where(model)}{_key(model, key)} is {value}; it must be at least 1")
    return fields


def rank_bytes(cfg: Config, size: ModelSize) -> list[int]:
    """Estimated bytes of each pipeline rank: the training state of the stages it holds (sharded
    over FSDP's ranks), plus the last stage's logits of one microbatch."""
    par, layout = cfg.parallel, cfg.layout
    num_stages = layout.num_stages
    blocks = (
        [len(stage) for stage in par.stage_layers]
        if par.stage_layers is not None and len(par.stage_layers) == num_stages
        else [size.num_blocks // num_stages + (s < size.num_blocks % num_stages) for s in range(num_stages)]
    )
    state_bytes_per_param = 4 * (2 + cfg.train.optimizer_state()[0])  # fp32 weights, grads, optimizer values
    # the last stage's output per sample: token logits, a classifier's, a forecast's
    output_values = task_io(cfg, vocab=size.vocab).output_values
    out = []
    for rank in range(par.pp):
        stages = layout.stages_of(rank)
        params = sum(blocks[s] * size.block for s in stages)
        params += size.embed * (0 in stages) + size.head * (num_stages - 1 in stages)
        # a cp rank holds 1 / cp of each sample's positions, and their logits
        logits = cfg.train.micro_batch * output_values * LOGIT_BYTES * (num_stages - 1 in stages) // layout.cp
        out.append(params * state_bytes_per_param // layout.shard_degree + logits)
    return out


def total_params(size: ModelSize) -> int:
    return size.embed + size.block * size.num_blocks + size.head


def _read_config_json(path: Path, where: str) -> dict[str, Any]:
    try:  # read_json bounds its size (json_files.MAX_JSON_BYTES)
        fields = read_json(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}config.json is not readable JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{where}config.json is not a JSON object; point model.hf at a model folder")
    return fields


def _size(model: HFSection, fields: dict[str, Any], names: tuple[str, ...]) -> int:
    """The first of `names` the config sets (checked by hf_fields), or transformers' default."""
    for name in names:
        if fields.get(name) is not None:
            return fields[name]
    value = getattr(load_hf_config(model), names[0], None)  # the family's default, from transformers
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{_where(model)}{_key(model, names[0])} is {value!r}; set it to a whole number >= 1")
    return value


def _where(model: ModelConfig) -> str:
    """Prefix naming where the sizes are set: the model folder, the inline config, or the model section."""
    if not isinstance(model, HFSection):
        return ""
    if model.hf is not None:
        return f"model.hf {model.hf}: "
    return "model.hf_config: "


def _key(model: ModelConfig, hf_key: str, builtin_key: str = "") -> str:
    if not isinstance(model, HFSection):
        return builtin_key
    return f"config.json {hf_key}" if model.hf is not None else hf_key


def _sizes_named(model: ModelConfig) -> str:
    if isinstance(model, HFSection):
        return "hidden_size, intermediate_size, num_hidden_layers and vocab_size"
    return "model.dim, model.num_layers, model.vocab_size and model.seq_len"
