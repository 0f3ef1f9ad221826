"""The `model` section: the keys every model shares, and one section per model family, chosen by
`model.name` (a discriminated union), so a key of another family is refused instead of ignored.

Families: gpt, encdec and encoder (built in), hf (a Hugging Face layout: `model.hf` or `model.hf_config`;
setting either is enough, as before `name: hf` existed), and a user's `model.factory`, which gets
the shared keys and free-form `model.options`. Older configs wrote every key of every family (a
run folder's config.json): a key of another family left at its default is dropped, not refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from meshrun.config.fields import Float, Int, Section
from meshrun.errors import ConfigError

BUILTIN_NAMES = ("gpt", "encdec", "encoder", "timeseries")  # the built-in families, in the order messages list them


class LoraSection(Section):
    """LoRA adapters (peft's LoraConfig keys of the same names): the base model frozen, only these train."""

    r: Int = Field(default=16, ge=1)
    """Rank of each adapter (its A is r x in_features, its B out_features x r)."""
    alpha: Int = Field(default=32, ge=1)
    """Scale of the adapter's output: alpha / r (peft's lora_alpha, an integer as peft types it)."""
    dropout: Float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (peft's lora_dropout); 0 keeps runs deterministic across layouts."""
    target_modules: list[str] | Literal["all-linear"] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    """Modules to adapt, by name as peft matches them (a module whose name is, or ends in `.NAME`), or
    `all-linear`: every linear layer of the blocks (peft's meaning: the output head is left out)."""
    base_dtype: Literal["auto", "folder", "fp32"] = "auto"
    """The frozen base's dtype in memory (the adapters, their gradients and AdamW state are fp32 in
    every case): folder = each weight as the model folder stores it (bf16 for released models),
    loaded bit for bit; fp32 = upcast, as full fine-tuning holds its weights; auto = folder under
    precision bf16 or fp16 (autocast computes in half precision anyway), fp32 under precision fp32.
    A base without a folder's weights (model.init random, model.hf_config) is fp32."""

    @model_validator(mode="after")
    def _some_targets(self) -> LoraSection:
        """model.lora.target_modules names at least one module, each non-empty."""
        if isinstance(self.target_modules, list) and not all(name.strip() for name in self.target_modules):
            raise ValueError("model.lora.target_modules must name modules (e.g. [q_proj, v_proj]) or be all-linear")
        if not self.target_modules:
            raise ValueError("model.lora.target_modules is empty: name modules (e.g. [q_proj, v_proj]) or all-linear")
        return self


class MoEBalanceSection(Section):
    """A Mixture-of-Experts model's load-balancing loss (models/moe_balance.py; docs/guides/moe.md)."""

    aux_loss: Literal["sequence", "microbatch", "none"] = "sequence"
    """sequence: DeepSeek's per-sequence balance loss averaged over the global batch's sequences (its value
    does not depend on the layout); microbatch: transformers' batch-level loss (`output_router_logits`) per
    microbatch, which depends on train.micro_batch and needs parallel.pp 1; none: no balance loss."""
    aux_loss_coef: Float | None = Field(default=None, ge=0.0)
    """Weight of the balance loss in the training loss; None: a Hugging Face config's router_aux_loss_coef,
    0.01 for the built-in gpt."""


class MoESection(MoEBalanceSection):
    """The built-in gpt's Mixture-of-Experts MLPs (models/moe.py): a top-k router over gated experts, dropless."""

    num_experts: Int = Field(default=8, ge=1)
    """Experts in each MoE layer."""
    top_k: Int = Field(default=2, ge=1)
    """Experts each token is routed to (at most model.moe.num_experts)."""
    expert_dim: Int | None = Field(default=None, ge=1)
    """Hidden width of each expert's gated MLP; None: 4 x model.dim / top_k (the dense MLP's active width)."""
    gate: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Mixtral, Qwen) or per-expert sigmoid (DeepSeek-V3), top-k weights
    renormalised to sum to 1 for sigmoid."""
    norm_topk_prob: bool = True
    """softmax: renormalise the top-k probabilities to sum to 1 (Qwen3-MoE's norm_topk_prob; Mixtral's routing)."""
    sparse_every: Int = Field(default=1, ge=1)
    """Every n-th block (n, 2n, ...; counted from 1) holds MoE experts, the others the dense MLP (Qwen's decoder_sparse_step)."""

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoESection:
        """model.moe.top_k is at most model.moe.num_experts."""
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) exceeds model.moe.num_experts ({self.num_experts}); lower top_k"
            )
        return self


class ModelSection(Section):
    """Keys every model family reads."""

    family: ClassVar[str]  # the union's tag: the built-in name, "hf" or "factory"
    factory: str | None = None
    """`package.module:function` that builds your own model from this section (see models/__init__.py)."""
    num_layers: Int = Field(default=4, ge=1)
    """Number of Transformer blocks."""
    dim: Int = Field(default=128, ge=1)
    """Hidden width."""
    num_heads: Int = Field(default=4, ge=1)
    """Attention heads; must divide `dim`."""
    seq_len: Int = Field(default=128, ge=2)
    """Tokens per sample (context length)."""
    vocab_size: Int = Field(default=256, ge=2)
    """Vocabulary size; 256 for the byte-level datasets made by `meshrun prepare-data`."""
    dropout: Float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout probability (0 keeps runs deterministic across layouts)."""
    options: dict[str, Any] = {}
    """Free-form extra arguments for a custom `factory`."""
    lora: LoraSection | None = None
    """LoRA fine-tuning with peft: adapters on `target_modules`, every other weight frozen (None: train every weight)."""

    @model_validator(mode="after")
    def _lora_wraps(self) -> ModelSection:
        """model.lora: a Hugging Face model (model.hf / model.hf_config); the built-in families and
        model.factory models are not adapted yet."""
        if self.lora is not None and self.family != "hf":
            what = "a model.factory model" if self.family == "factory" else f"model.name {self.family}"
            raise ValueError(
                f"model.lora adapts Hugging Face models (model.hf / model.hf_config) only, not {what} yet: "
                "remove model.lora to train every weight"
            )
        return self

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> ModelSection:
        """model.num_heads divides model.dim (each head gets dim / num_heads channels)."""
        if self.dim % self.num_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must divide model.dim ({self.dim}); change one of these keys"
            )
        return self

    def tp_splits(self) -> dict[str, int]:
        """The sizes tensor parallelism divides among parallel.tp ranks, by the key that sets each
        (checked before any worker). Default: none known from the config alone."""
        return {}

    def sequence_splits(self, buckets: Sequence[int] = ()) -> dict[str, int]:
        """The lengths sequence parallelism splits among parallel.tp ranks, by the key that sets each
        (a length bucket's batches are that long)."""
        return {"model.seq_len": self.seq_len} | {f"data.buckets[{i}]": n for i, n in enumerate(buckets)}


class GPTBlocksSection(ModelSection):
    """A family built of GPT's blocks (gpt, encoder, timeseries): their tp plan's divisor."""

    def tp_splits(self) -> dict[str, int]:
        """Whole heads per tp shard (which also splits model.dim and the MLP width 4 x dim, multiples
        of the heads). The vocabulary needs no divisor: DTensor shards it unevenly, and the loss is
        the same (tests/parallel/test_tensor_parallel.py)."""
        return {"model.num_heads": self.num_heads}


class GPTSection(GPTBlocksSection):
    family: ClassVar[str] = "gpt"
    name: Literal["gpt"] = "gpt"
    """Built-in model to train: gpt, encdec, encoder, timeseries; hf with model.hf / model.hf_config; ignored when `factory` is set."""
    moe: MoESection | None = None
    """gpt: Mixture-of-Experts MLPs (models/moe.py) instead of dense ones; None: dense."""


class EncDecSection(ModelSection):
    family: ClassVar[str] = "encdec"
    name: Literal["encdec"] = "encdec"
    """Built-in model to train: gpt, encdec, encoder, timeseries; hf with model.hf / model.hf_config; ignored when `factory` is set."""
    encoder_layers: Int | None = Field(default=None, ge=1)
    """encdec: how many of the num_layers blocks are encoder blocks (the rest decode); None = half."""
    source_len: Int | None = Field(default=None, ge=1)
    """encdec: tokens of seq_len that hold the source (the rest hold the target); None = half."""
    positions: Literal["learned", "sinusoidal"] = "learned"
    """encdec: learned position embeddings or fixed sinusoids ("Attention is all you need")."""
    tie_embeddings: bool = False
    """encdec: one token embedding matrix for the encoder, the decoder and the output head."""

    def tp_splits(self) -> dict[str, int]:
        """Whole heads per tp shard, as GPT's (self- and cross-attention alike)."""
        return {"model.num_heads": self.num_heads}

    def sequence_splits(self, buckets: Sequence[int] = ()) -> dict[str, int]:
        """The source and the target split by position: the source and the whole of each length
        (a bucket keeps the source's share of its length)."""
        source = self.source_len or self.seq_len // 2
        shares = {f"data.buckets[{i}]'s source share": n * source // self.seq_len for i, n in enumerate(buckets)}
        return super().sequence_splits(buckets) | {"model.source_len": source} | shares


class EncoderSection(GPTBlocksSection):
    family: ClassVar[str] = "encoder"
    name: Literal["encoder"] = "encoder"
    """Built-in model to train: gpt, encdec, encoder, timeseries; hf with model.hf / model.hf_config; ignored when `factory` is set."""
    num_labels: Int = Field(default=2, ge=2)
    """encoder (task classification): the classes its head scores; must equal the data's label count (meta.json)."""
    head: Literal["labels", "tokens"] = "labels"
    """encoder: labels (its states pooled into model.num_labels scores: task classification) or tokens (a
    model.vocab_size score per position: task masked_lm); set from the task when not given."""

    @model_validator(mode="after")
    def _labels_need_a_label_head(self) -> EncoderSection:
        """model.num_labels sizes the labels head: refused beside head tokens rather than ignored."""
        if self.head == "tokens" and self.num_labels != EncoderSection.model_fields["num_labels"].default:
            raise ValueError(
                "model.num_labels sizes a classifier's head; an encoder with head tokens has none: remove it"
            )
        return self


class TimeSeriesSection(GPTBlocksSection):
    family: ClassVar[str] = "timeseries"
    name: Literal["timeseries"] = "timeseries"
    """Built-in model to train: gpt, encdec, encoder, timeseries; hf with model.hf / model.hf_config; ignored when `factory` is set."""
    features: Int = Field(default=1, ge=1)
    """timeseries (task regression): values per time step (the data's columns); must equal meta.json's column count."""
    horizon: Int = Field(default=1, ge=1)
    """timeseries (task regression): future steps its head predicts; must equal task_options.horizon."""


class HFSection(ModelSection):
    family: ClassVar[str] = "hf"
    name: Literal["hf"] = "hf"
    """hf: a Hugging Face layout (set by model.hf or model.hf_config alone)."""
    hf: str | None = None
    """Local Hugging Face model directory (config.json; optional safetensors, tokenizer); nothing is downloaded."""
    hf_config: dict[str, Any] | None = None
    """Inline Hugging Face config ({model_type: llama, ...}) to build from instead of a directory."""
    init: Literal["auto", "random", "pretrained"] = "auto"
    """Hugging Face models: pretrained = the directory's safetensors, random = seeded per-name init, auto = weights if present."""
    num_labels: Int | None = Field(default=None, ge=2)
    """task classification: the labels the score head maps to (transformers' `*ForSequenceClassification`, last-token
    pooling); must equal the data's label count (meta.json). None: a language-model head (every other task)."""
    moe: MoEBalanceSection | None = None
    """A Hugging Face Mixture-of-Experts model's balance loss (qwen3_moe, qwen2_moe, mixtral, olmoe); None: its
    defaults. Refused for a model without MoE layers."""

    @model_validator(mode="after")
    def _one_hf_source(self) -> HFSection:
        """Exactly one of model.hf (a directory) and model.hf_config (inline)."""
        if self.hf is not None and self.hf_config is not None:
            raise ValueError("set model.hf (a directory) or model.hf_config (inline), not both")
        if self.hf is None and self.hf_config is None:
            raise ValueError("model.name hf needs model.hf (a directory) or model.hf_config (inline)")
        if self.factory is not None:  # the factory would never be called: the user's wrapper silently lost
            source = "model.hf" if self.hf is not None else "model.hf_config"
            raise ValueError(
                f"set model.factory or {source}, not both: a factory builds the whole model (load the "
                f"Hugging Face model inside it and remove {source})"
            )
        return self


class FactorySection(ModelSection):
    family: ClassVar[str] = "factory"
    name: str = "gpt"
    """Ignored: `factory` builds the model."""


SECTIONS: dict[str, type[ModelSection]] = {
    s.family: s for s in (GPTSection, EncDecSection, EncoderSection, TimeSeriesSection, HFSection, FactorySection)
}
_HF_KEYS = ("hf", "hf_config")


def _tag(data: Any) -> str | None:
    """The family of a section (validated) or of its keys (after `route_model`)."""
    if isinstance(data, ModelSection):
        return data.family
    if not isinstance(data, dict):
        return None  # pydantic reports that the section is no mapping
    name = data.get("name", "gpt")
    return name if name == "hf" or data.get("factory") is None else "factory"


ModelConfig = Annotated[
    Annotated[GPTSection, Tag("gpt")]
    | Annotated[EncDecSection, Tag("encdec")]
    | Annotated[EncoderSection, Tag("encoder")]
    | Annotated[TimeSeriesSection, Tag("timeseries")]
    | Annotated[HFSection, Tag("hf")]
    | Annotated[FactorySection, Tag("factory")],
    Discriminator(_tag),
]
"""The `model` section of one family (what `model.factory` receives)."""


def route_model(data: dict[str, Any]) -> dict[str, Any]:
    """The model keys as their family's section takes them: `hf`/`hf_config` alone mean name hf, and a
    key of another family is dropped at its default (older config.json files wrote all) or refused."""
    if any(data.get(key) is not None for key in _HF_KEYS) and data.get("name", "gpt") == "gpt":
        data = {**data, "name": "hf"}  # gpt: the old default, which older configs wrote beside model.hf
    family = _tag(data)
    if not isinstance(family, str) or family not in SECTIONS:
        raise ConfigError(
            f"invalid model.name {data.get('name')!r}: choose one of {', '.join(BUILTIN_NAMES)} or set model.factory"
        )
    own = SECTIONS[family].model_fields
    kept = {}
    for key, value in data.items():
        owner = next((s for s in SECTIONS.values() if key in s.model_fields and key not in own), None)
        if owner is None:
            kept[key] = value  # its own key, or an unknown one (refused by name, with a suggestion)
        elif value != owner.model_fields[key].default:
            raise ConfigError(_foreign(key, owner.family, family))
    return kept


def _foreign(key: str, owner: str, family: str) -> str:
    """One line for a key of another family's section."""
    belongs = f"model.{key} is a key of model.name {owner}"
    if family == "factory":
        return f"{belongs}; a model.factory model gets the shared keys: put its settings in model.options"
    return f"{belongs}, not of model.name {family}: remove it, or set model.name: {owner}"
