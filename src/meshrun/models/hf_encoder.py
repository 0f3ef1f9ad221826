"""Hugging Face encoders (BERT) as text classifiers (task classification), with the semantics of
transformers' `BertForSequenceClassification`: the embeddings, the bidirectional layers with the
padding masked out of attention, then the pooler (dense + tanh) on each text's first position,
dropout and `classifier`, a Linear with bias, to (B, num_labels) logits. No distributed code lives here.

Built by transformers itself (`AutoModelForSequenceClassification.from_config`, sdpa), its parts
re-homed: `embed` (bert.embeddings), `blocks` (bert.encoder.layer[i]), `head` (pooler, dropout,
classifier); no final norm (BERT's layers end in their own LayerNorm). Between stages the state is
(hidden (B, T, C), keep (B, T) int64), as the built-in encoder's. The data holds the tokenizer's ids
with no [CLS] added, so the pooled position is each text's first token, as transformers pools
position 0 of whatever ids it is given. Weights: tensors the folder holds load (a
BertForSequenceClassification folder: all); the pooler and classifier a folder lacks (BertModel,
BertForMaskedLM) start from the seeded init, the body must be there.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshrun.config.model_sections import HFSection
from meshrun.data.labelled_batches import PAD
from meshrun.errors import ConfigError
from meshrun.models.hf_config import ENCODER_TYPES, load_hf_config
from meshrun.models.hf_weights import check_shapes, load_weights, pretrained_folder, weight_index
from meshrun.models.init import seeded_normal_
from meshrun.models.protocol import StagedModel

NAMES = (  # meshrun name prefix -> transformers' (BertForSequenceClassification)
    ("embed.", "bert.embeddings."),
    ("blocks.", "bert.encoder.layer."),
    ("head.pooler.", "bert.pooler."),
    ("head.classifier.", "classifier."),
)


def is_encoder(cfg: HFSection) -> bool:
    """A Hugging Face encoder: trained only as task classification (refused with another task)."""
    model_type = load_hf_config(cfg).model_type
    if model_type in ENCODER_TYPES and cfg.num_labels is None:
        raise ConfigError(
            f"model_type {model_type} is an encoder: meshrun trains it as task classification with model.num_labels"
        )
    return model_type in ENCODER_TYPES


class PooledHead(nn.Module):
    """transformers' pooler on the first position, dropout, classifier: state -> (B, num_labels)."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(state[0])))


class HFEncoderClassifier(StagedModel):
    """BertForSequenceClassification's parts, split over pipeline stages like the built-in encoder."""

    def __init__(self, cfg: HFSection) -> None:
        from transformers import AutoModelForSequenceClassification

        super().__init__()
        if cfg.lora is not None:
            raise ConfigError("model.lora with task classification: not in this version; remove model.lora")
        self.cfg = cfg
        self.hf_config = copy.deepcopy(load_hf_config(cfg))
        self.hf_config.num_labels = cfg.num_labels
        hf: Any = AutoModelForSequenceClassification.from_config(
            self.hf_config, attn_implementation="sdpa", dtype=torch.float32, trust_remote_code=False
        )
        self.hf_class_name = type(hf).__name__  # for export's config.json `architectures`
        self.pad_id = int(self.hf_config.pad_token_id or 0)
        self.embed: nn.Module | None = hf.bert.embeddings
        self.blocks = nn.ModuleDict({str(i): layer for i, layer in enumerate(hf.bert.encoder.layer)})
        self.norm: nn.Module | None = None
        self.head: nn.Module | None = PooledHead(hf.bert.pooler, hf.dropout, hf.classifier)

    def forward(self, *inputs: torch.Tensor) -> Any:
        """Token ids (B, T), PAD after each text -> logits (B, num_labels); a stage after the first
        receives (hidden, keep), a stage before the last hands them on."""
        if self.embed is not None:
            ids = inputs[0]
            keep = (ids != PAD).long()
            x = self.embed(input_ids=ids.masked_fill(ids == PAD, self.pad_id))
        else:
            x, keep = inputs
        mask = keep.bool()[:, None, None, :].expand(-1, 1, keep.shape[1], -1)  # (B, 1, T, T): keys kept
        for block in self.blocks.values():
            x = block(x, attention_mask=mask)
        return self.head((x, keep)) if self.head is not None else (x, keep)

    def hf_names(self, name: str) -> list[str]:
        ours, theirs = next((o, t) for o, t in NAMES if name.startswith(o))
        return [theirs + name[len(ours) :]]

    def hf_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The parameters by our name (the embeddings' position and type ids are buffers, not in the files)."""
        return {name: [p] for name, p in self.named_parameters()}

    def pretrained_dir(self) -> Path | None:
        return pretrained_folder(self.cfg)

    def fresh_weights(self) -> list[str]:
        """The head's tensors the folder lacks (a BertModel or BertForMaskedLM folder): seeded; the body must load."""
        path = self.pretrained_dir()
        if path is None:
            return []
        held = weight_index(path)
        return [n for n in self.hf_tensors() if n.startswith("head.") and self.hf_names(n)[0] not in held]

    def check_weights(self) -> None:
        path = self.pretrained_dir()
        if path is not None:
            fresh = self.fresh_weights()
            check_shapes({n: t for n, t in self.hf_tensors().items() if n not in fresh}, self.hf_names, path)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The folder's tensors where it holds them, else a seeded init per name (matrices normal of
        std initializer_range, biases 0, LayerNorm scales 1); the embeddings' id buffers rebuilt."""
        embeddings: Any = self.embed  # transformers' BertEmbeddings
        if embeddings is not None:  # non-persistent buffers: empty after the meta build
            ids = embeddings.position_ids
            ids.copy_(torch.arange(ids.shape[-1], device=ids.device).expand_as(ids))
            embeddings.token_type_ids.zero_()
        path = self.pretrained_dir()
        fresh = self.fresh_weights() if path is not None else list(self.hf_tensors())
        if path is not None:
            load_weights({n: t for n, t in self.hf_tensors().items() if n not in fresh}, self.hf_names, path)
        for name, param in self.named_parameters():
            if name not in fresh:
                continue
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            else:
                seeded_normal_(param, seed, name, std=self.hf_config.initializer_range)

    def flops_per_token(self, length: int | None = None) -> float:
        """6 x the layers' matmul params + attention over the whole `length` (every position sees
        every other); the head runs once per text and is left out."""
        c = self.hf_config
        blocks = sum(p.numel() for n, p in self.named_parameters() if n.startswith("blocks."))
        return 6.0 * blocks + 12.0 * c.num_hidden_layers * c.hidden_size * (length or self.cfg.seq_len)
