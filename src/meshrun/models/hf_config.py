"""Hugging Face configs from a local directory or an inline dict, the layouts meshrun adapts (one
record each), and the model sizes meshrun plans with.

`num_layers` / `vocab_size` are the one place the rest of meshrun (stage split, describe,
data checks) asks how deep and wide the model is: the HF config rules when there is one,
`model.num_layers` / `model.vocab_size` otherwise. Nothing here downloads anything.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, TypeGuard

from meshrun.config.context import check_context_split, unsupported
from meshrun.config.model_sections import HFSection, ModelConfig
from meshrun.config.schema import Config
from meshrun.config.topology import check_tensor_split
from meshrun.errors import ConfigError
from meshrun.files.confined import confined
from meshrun.files.json_reader import MAX_JSON_BYTES, read_json


@dataclass(frozen=True)
class HFLayout:
    """Every fact meshrun holds about one Hugging Face layout (the model types that share its
    module names): where models/hf.py finds the parts, and how their tensors are named."""

    name: str
    model_types: tuple[str, ...]
    base: str
    """The decoder's module ("model" / "transformer"); older files name tensors without its prefix."""
    names: tuple[tuple[str, str], ...]
    """meshrun name prefix -> Hugging Face name prefix."""
    tied_weight: str
    """The embedding matrix a tied head reads, by its meshrun name (the same on every stage)."""
    rotary: bool
    """Rotary positions, computed once per stage forward (else learned positions inside `embed`)."""
    window_types: tuple[str, ...] = ()
    """Model types whose `sliding_window` applies to every layer (others: only with `layer_types`)."""

    def hf_names(self, name: str, *, tied: bool) -> list[str]:
        """Hugging Face keys for one of our tensor names, most likely first."""
        ours, theirs = next((o, t) for o, t in self.names if name.startswith(o))
        keys = [theirs + name[len(ours) :], *(["lm_head.weight"] if tied and name == self.tied_weight else [])]
        prefix = f"{self.base}."
        return keys + [k.removeprefix(prefix) for k in keys if k.startswith(prefix)]


LAYOUTS = (
    HFLayout(
        "llama",
        ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"),
        base="model",
        names=(
            ("embed.", "model.embed_tokens."),
            ("blocks.", "model.layers."),
            ("norm.", "model.norm."),
            ("head.", "lm_head."),
        ),
        tied_weight="embed.weight",
        rotary=True,
        window_types=("mistral", "phi3"),
    ),
    HFLayout(
        "gpt2",
        ("gpt2",),
        base="transformer",
        names=(
            ("embed.", "transformer."),
            ("blocks.", "transformer.h."),
            ("norm.", "transformer.ln_f."),
            ("head.", "lm_head."),
        ),
        tied_weight="embed.wte.weight",
        rotary=False,
    ),
)
LAYOUT_OF = {model_type: layout for layout in LAYOUTS for model_type in layout.model_types}
"""model_type -> its layout: the supported Hugging Face families."""
ENCODER_TYPES = ("bert",)
"""Hugging Face encoders meshrun trains as classifiers only (task classification, models/hf_encoder.py)."""
FUSED_PROJECTIONS = {"gpt2": "c_attn, a Conv1D of q, k and v"}
"""Model types whose layers slice one fused projection by the config's head counts (transformers'
forward, which meshrun runs as it is): a column split would cut across q, k and v, so tensor
parallelism refuses them."""
FUSED_PARTS = ("phi3",)
"""Model types whose fused projections (Phi-3's qkv_proj, gate_up_proj) meshrun holds as their
parts at every tp (models/hf.py's FusedParts), so a column split of each part keeps whole heads."""
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
"""Model types with Mixture-of-Experts layers (models/hf_moe.py): under tp their sparse MLPs stay whole."""
QK_NORMS = {"qwen3": "per_head", "olmo2": "whole_width", "qwen3_moe": "per_head", "olmoe": "whole_width"}
"""Model types with q_norm / k_norm, and what they normalise: each head, or the whole projected width."""
TOKENIZERS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of them makes a tokenizer
TOKENIZER_FILES = (  # what export copies into a Hugging Face folder, and transformers reads
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
INDEX = "model.safetensors.index.json"  # sharded weights: tensor name -> file
SINGLE = "model.safetensors"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def is_hf(cfg: ModelConfig) -> TypeGuard[HFSection]:
    return isinstance(cfg, HFSection)


def num_layers(cfg: ModelConfig) -> int:
    """Decoder blocks of the model the config builds."""
    return load_hf_config(cfg).num_hidden_layers if is_hf(cfg) else cfg.num_layers


def vocab_size(cfg: ModelConfig) -> int:
    return load_hf_config(cfg).vocab_size if is_hf(cfg) else cfg.vocab_size


def vocab_key(cfg: ModelConfig) -> str:
    """Where the model's vocabulary size is set, for messages that ask to change it."""
    if not isinstance(cfg, HFSection):
        return "model.vocab_size"
    return "vocab_size in model.hf_config" if cfg.hf_config is not None else f"vocab_size in {cfg.hf}/config.json"


def hf_dir(cfg: ModelConfig) -> Path | None:
    """The checked model directory of `model.hf` (None for an inline config or another family)."""
    if not isinstance(cfg, HFSection) or cfg.hf is None:
        return None
    path = Path(cfg.hf).expanduser()
    if not path.is_dir():
        if not path.exists() and _HUB_ID.match(cfg.hf):
            raise ConfigError(
                f"model.hf {cfg.hf!r} looks like a Hugging Face hub id, but it is not a local directory; meshrun downloads "
                f"nothing: fetch it first (e.g. `hf download {cfg.hf} --local-dir DIR`) and set model.hf to DIR"
            )
        raise ConfigError(f"model.hf {cfg.hf} is not a directory; set it to a folder holding config.json")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.hf {cfg.hf} has no config.json; point it at a Hugging Face model folder")
    check_model_files(path)
    return path


def check_model_files(model_dir: Path) -> None:
    """Every file meshrun or transformers reads from a model folder stays inside it (a link out,
    or a tokenizer_config.json naming `../x`, is refused), and its JSON files are of a sane size."""
    root = model_root(model_dir)
    for name in ("config.json", INDEX, SINGLE, *TOKENIZER_FILES):
        file = model_dir / name
        if file.is_symlink() or file.exists():
            confined(model_dir, name, source=model_dir, within=root)
        if name.endswith(".json") and file.is_file() and file.stat().st_size > MAX_JSON_BYTES:
            raise ConfigError(f"{file} is over {MAX_JSON_BYTES // 2**20} MiB: not a model's JSON file")
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        try:
            named = read_json(tokenizer_config).get("fast_tokenizer_files") or []
        except (OSError, ValueError, AttributeError):
            return  # transformers reports an unreadable one itself
        for entry in named if isinstance(named, list) else [named]:
            confined(model_dir, entry, source=tokenizer_config, within=root)


def model_root(model_dir: Path) -> Path:
    """The folder a model folder's files must stay in: itself, or for a snapshot of the Hugging
    Face hub cache (REPO/snapshots/REVISION, whose files are links into REPO/blobs) the REPO folder."""
    snapshots = model_dir.resolve().parent
    if snapshots.name == "snapshots" and (snapshots.parent / "blobs").is_dir():
        return snapshots.parent
    return model_dir


def model_file(model_dir: Path, entry: str, *, source: Path) -> Path:
    """A file a model folder's index names, confined to the folder (see `model_root`)."""
    return confined(model_dir, entry, source=source, within=model_root(model_dir))


def model_tokenizer(model_dir: Path | None) -> Path | None:
    """The file that makes a model folder's tokenizer (tokenizer.json, else a sentencepiece
    tokenizer.model, else GPT-2 style vocab.json), or None when it ships none."""
    if model_dir is None:
        return None
    return next((model_dir / n for n in TOKENIZERS if (model_dir / n).is_file()), None)


def load_hf_config(cfg: HFSection) -> Any:
    """The transformers config (a `PretrainedConfig`), checked to be a supported family."""
    inline = json.dumps(cfg.hf_config, sort_keys=True) if cfg.hf_config is not None else None
    return _load(cfg.hf, inline)


@lru_cache(maxsize=8)
def _load(hf: str | None, inline: str | None) -> Any:
    from transformers import AutoConfig

    if inline is not None:
        fields = json.loads(inline)
        model_type, key = fields.pop("model_type", None), "model.hf_config"
        _check_family(model_type, key)
        load = partial(AutoConfig.for_model, model_type, **fields)
    else:
        path = hf_dir(HFSection(hf=hf))
        assert path is not None  # without an inline config, model.hf is set
        key = f"model.hf {hf}"
        try:
            model_type = read_json(path / "config.json").get("model_type")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{key}: config.json is not readable JSON ({exc})") from None
        _check_family(model_type, key)
        load = partial(AutoConfig.from_pretrained, path, local_files_only=True, trust_remote_code=False)
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - transformers validates fields: report its reason in one line
        raise ConfigError(f"{key}: transformers cannot build this config: {type(exc).__name__}: {exc}") from None


def _check_family(model_type: object, key: str) -> None:
    if model_type not in LAYOUT_OF and model_type not in ENCODER_TYPES:
        supported = sorted([*LAYOUT_OF, *ENCODER_TYPES])
        raise ConfigError(f"{key}: model_type {model_type!r} is not supported; supported: {', '.join(supported)}")


def tp_splits(cfg: HFSection, tp: int) -> dict[str, int]:
    """The sizes tensor parallelism divides among `tp` ranks (whole heads, whole kv heads, the MLP
    width: also the sizes of Phi-3's fused q, k, v and gate, up parts), by where each is set; a
    layout with fused projections meshrun does not split into parts is refused in one line."""
    config = load_hf_config(cfg)
    if config.model_type in ENCODER_TYPES:
        raise ConfigError(
            f"parallel.tp {tp}: meshrun has no tensor-parallel plan for {config.model_type}; set parallel.tp=1"
        )
    if config.model_type in FUSED_PROJECTIONS:
        works = sorted(set(LAYOUT_OF) - set(FUSED_PROJECTIONS))
        raise ConfigError(
            f"parallel.tp {tp}: {config.model_type} fuses its projections ({FUSED_PROJECTIONS[config.model_type]}), "
            f"which tensor parallelism does not split; set parallel.tp=1 (dp, fsdp and pp work), or use one of "
            f"{', '.join(works)}"
        )
    where = "model.hf_config" if cfg.hf_config is not None else f"{cfg.hf}/config.json"
    sizes = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    return {f"{key} in {where}": getattr(config, key) for key in sizes}


def check_fits(cfg: HFSection) -> None:
    """Context length and attention window the adapters rely on, checked before any worker exists."""
    config = load_hf_config(cfg)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(
            f"model.seq_len {cfg.seq_len} exceeds the model's max_position_embeddings ({limit}); lower model.seq_len"
        )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    layout = LAYOUT_OF.get(config.model_type)
    sliding = "sliding_attention" in layer_types or (
        layout is not None and config.model_type in layout.window_types and window is not None
    )
    if sliding and window is not None and cfg.seq_len > window:
        raise ConfigError(
            f"model.seq_len {cfg.seq_len} exceeds the model's sliding_window ({window}); meshrun runs full causal "
            "attention (sdpa is_causal), so lower model.seq_len to at most the window"
        )


def check_hf_tensor_split(cfg: Config) -> None:
    """A Hugging Face model's sizes that tp splits (heads, kv heads, the MLP width: config.json
    sets them, so the schema cannot check them) divide by parallel.tp. `meshrun plan` keeps only
    the layouts that pass, as training would refuse the rest."""
    if cfg.parallel.tp > 1 and is_hf(cfg.model):
        splits = tp_splits(cfg.model, cfg.parallel.tp)
        check_tensor_split(cfg.parallel, splits, sequences=cfg.model.sequence_splits(cfg.data.buckets))


def check_hf_context_split(cfg: Config) -> None:
    """A Hugging Face model under parallel.cp: a decoder whose attention parallel/context.py splits,
    with its heads and kv heads (config.json sets them) divisible by tp x cp."""
    if cfg.parallel.cp > 1 and is_hf(cfg.model):
        config = load_hf_config(cfg.model)
        where = "model.hf_config" if cfg.model.hf_config is not None else f"{cfg.model.hf}/config.json"
        refused = unsupported("hf", cfg.task, config.model_type)
        keys = ("num_attention_heads", "num_key_value_heads") if refused is None else ()  # gpt2 names them otherwise
        heads = {f"{key} in {where}": getattr(config, key) for key in keys}
        check_context_split(cfg.parallel, refused=refused, heads=heads, sequences={})
