"""Hugging Face decoders as text classifiers (task classification), with the semantics of
transformers' own `*ForSequenceClassification` (LlamaForSequenceClassification and the other
layouts' classes): the decoder, its final norm, then each text's hidden state at its last token
that is not the padding token (the rightmost such position, as transformers picks it) through
`score`, a Linear with no bias, to (B, num_labels) logits. No distributed code lives here.

Input: token ids (B, T) as data/labelled_batches.py pads them (PAD after each text). The first
stage writes the config's pad_token_id where PAD is, which is what transformers' model reads, and
marks the tokens that are not it; between stages the state is (hidden (B, T, C), keep (B, T) int64,
as the built-in encoder's), so the last stage, which owns the norm, the pooling and `score`, finds
where each text ends. Causal
attention alone (no padding mask) gives the pooled position's state exactly: it attends only to
the positions before it, never to the padding after it.

Weights (`model.init` as for the language model): a folder saved from `*ForSequenceClassification`
loads whole (`score.weight` included; its config's num_labels must equal model.num_labels); a folder
saved from a causal LM (`*ForCausalLM`, GPT-2's `GPT2LMHeadModel`) loads everything but its head,
and `score` starts from the seeded normal init transformers gives a new head (std initializer_range).
Folders of other heads are refused.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from meshrun.config.model_sections import HFSection
from meshrun.data.labelled_batches import PAD
from meshrun.errors import ConfigError
from meshrun.models.hf import HFCausalLM
from meshrun.models.hf_config import load_hf_config
from meshrun.models.hf_weights import weight_index
from meshrun.models.init import seeded_normal_

CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # architectures of folders whose body loads under a fresh score


class HFSequenceClassifier(HFCausalLM):
    """A Hugging Face decoder with transformers' sequence-classification head, split over stages like the LM."""

    takes_documents = False  # one text a row, padded: never packed
    auto_class = "AutoModelForSequenceClassification"
    head_name = "score"

    def __init__(self, cfg: HFSection) -> None:
        if cfg.lora is not None:
            raise ConfigError(
                "model.lora with task classification: the new score head would stay frozen; remove model.lora "
                "(this version fine-tunes every weight of a classifier)"
            )
        super().__init__(cfg)
        self.pad_id = int(self.hf_config.pad_token_id)

    def config_of(self, cfg: HFSection) -> Any:
        """A copy of the folder's config with model.num_labels and no tied head; refused in one line
        when its family has no sequence-classification form or it names no pad_token_id."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

        config = copy.deepcopy(super().config_of(cfg))
        where = "model.hf_config" if cfg.hf_config is not None else f"{cfg.hf}/config.json"
        if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
            raise ConfigError(
                f"{where}: model_type {config.model_type} has no sequence-classification form in transformers, so "
                "task classification cannot train it; use another family or model.name encoder"
            )
        if getattr(config, "pad_token_id", None) is None:
            eos = getattr(config, "eos_token_id", None)
            hint = f" (e.g. the eos id, {eos})" if isinstance(eos, int) else ""
            raise ConfigError(
                f"{where} sets no pad_token_id, which last-token pooling needs to find where each text ends "
                f"(as transformers' *ForSequenceClassification does); set pad_token_id in {where}{hint}"
            )
        config.num_labels = cfg.num_labels
        config.tie_word_embeddings = False
        return config

    def hf_names(self, name: str) -> list[str]:
        """The score head is `score.*` in transformers' files; the rest is named as the LM's."""
        return [f"score.{name.removeprefix('head.')}"] if name.startswith("head.") else super().hf_names(name)

    def pretrained_tensors(self, path: Path) -> dict[str, list[torch.Tensor]]:
        """Everything from a *ForSequenceClassification folder; all but the head from a causal LM's."""
        fresh = self.fresh_weights()
        return {name: parts for name, parts in self.hf_tensors(path).items() if name not in fresh}

    def fresh_weights(self) -> list[str]:
        """The tensors drawn from the seed although weights load: the score a causal-LM folder lacks."""
        path = self.pretrained_dir()
        if path is None or self.head is None or folder_holds_score(self.cfg, path):
            return []
        return [name for name, _ in self.head.named_parameters(prefix="head")]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """As the LM's; a head the folder does not hold starts from transformers' init of a new head,
        a normal of std initializer_range, seeded per name."""
        super().init_weights(seed)
        fresh = self.fresh_weights()
        for name, param in self.named_parameters():
            if name in fresh:
                seeded_normal_(param, seed, name, std=self.hf_config.initializer_range)

    def forward(self, *inputs: torch.Tensor) -> Any:
        """Token ids (B, T), PAD after each text -> logits (B, num_labels); a stage after the first
        receives (hidden, keep), a stage before the last hands them on."""
        if self.embed is not None:
            ids = inputs[0].masked_fill(inputs[0] == PAD, self.pad_id)
            x, keep = self.embed(ids), (ids != self.pad_id).long()
        else:
            x, keep = inputs
        x = self.run_blocks(x)
        if self.head is None:
            return x, keep
        assert self.norm is not None  # the last stage holds norm and head
        pooled = self.norm(x)[torch.arange(x.shape[0], device=x.device), last_kept(keep)]  # (B, C)
        return self.head(pooled)

    def tp_plan(self) -> dict[str, str] | None:
        """The causal LM's split of the blocks, the embedding split by vocabulary without scattering
        positions (pooling reads the last text token of every row, so sequence parallel is refused
        before spawn), and the small `score` head whole on every tp rank."""
        plan = super().tp_plan()
        if plan is None:
            return None
        del plan["head"]
        return plan | {"embed": "vocab_embedding"}

    def flops_per_token(self, length: int | None = None) -> float:
        """The LM's count without the head: `score` runs once per text, not per token."""
        head = sum(p.numel() for p in self.head.parameters()) if self.head is not None else 0
        return super().flops_per_token(length) - 6.0 * head


def last_kept(keep: torch.Tensor) -> torch.Tensor:
    """Each row's rightmost position that `keep` (B, T) marks (0 for a row of padding): transformers'
    `(arange(T) * (ids != pad)).argmax(-1)`. (B,)"""
    return (torch.arange(keep.shape[-1], device=keep.device) * keep).argmax(-1)


def folder_holds_score(cfg: HFSection, path: Path) -> bool:
    """Whether the model folder at `path` was saved from *ForSequenceClassification (its score loads)
    or from a causal LM (a fresh score); refused in one line: another head, or a label count unlike
    model.num_labels."""
    config = load_hf_config(cfg)  # the folder's own, before config_of sets model.num_labels
    names = [str(a) for a in getattr(config, "architectures", None) or []]
    if any(a.endswith("ForSequenceClassification") for a in names):
        if config.num_labels != cfg.num_labels:
            raise ConfigError(
                f"model.hf {path} was saved from {names[0]} with {config.num_labels} labels (config.json id2label) "
                f"but model.num_labels is {cfg.num_labels}; its score head has one row per label: use a folder "
                f"with {cfg.num_labels} labels, or a causal-LM folder (whose head starts fresh)"
            )
        return True
    if names and not any(a.endswith(CAUSAL_SUFFIXES) for a in names):
        raise ConfigError(
            f"model.hf {path} was saved from {names[0]}; task classification loads a folder saved from "
            "*ForSequenceClassification (score loaded) or a causal LM (*ForCausalLM, a fresh score)"
        )
    if "score.weight" in weight_index(path):
        raise ConfigError(f"model.hf {path} holds score.weight but config.json names no *ForSequenceClassification")
    return False


def check_data_tokens(cfg: HFSection, data: Any) -> None:
    """Classification data (`data`: a LabelledDataset) holds the ids of the model folder's tokenizer,
    as for a language model: byte ids are refused for pretrained weights, another tokenizer's always."""
    from meshrun.data.dataset import check_pretrained_reads, check_same_tokenizer
    from meshrun.models.hf_config import hf_dir, model_tokenizer
    from meshrun.models.hf_weights import has_weights

    model_dir = hf_dir(cfg)
    tokenizer = model_tokenizer(model_dir)
    if model_dir is None or tokenizer is None or not data.tokenizer:
        return
    if cfg.init != "random" and has_weights(model_dir):
        check_pretrained_reads(data, tokenizer)
    check_same_tokenizer((data.tokenizer["name"], data.tokenizer["sha256"]), tokenizer)
