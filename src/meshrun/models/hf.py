"""Hugging Face decoder LMs under meshrun's model protocol. No distributed code lives here.

The model is built by transformers itself (`AutoModelForCausalLM.from_config`, sdpa attention,
on whatever device is current: meta when meshrun builds it), then its parts are re-homed:
`embed`, `blocks` (the HF decoder layers, keyed by their global index), `norm`, `head`. One
layout per family, not per class (its facts: `hf_config.LAYOUTS`); models/hf_classifier.py builds
the same layouts as `*ForSequenceClassification` (task classification):

- llama (llama, mistral, qwen2, qwen3, phi3, olmo2): `model.embed_tokens`, `model.layers[i]`, `model.norm`,
  `lm_head`; rotary position embeddings are computed once per stage forward (transformers
  computes them at model level, which a pipeline stage does not run) and passed to each layer.
  Phi-3's fused `qkv_proj` and `gate_up_proj` are held as their parts (`FusedParts`), whatever
  the layout, so checkpoints name the same tensors at every tp.
- gpt2: `transformer.wte` + `wpe` (learned positions), `transformer.h[i]`, `ln_f`, `lm_head`.

Layers get no attention mask: transformers' sdpa then takes its `is_causal` path, so no
(seq x seq) mask is ever built; a packed batch's layers get `position_ids`, and attention runs
within each document (models/documents.py: transformers' own sdpa function on each document's
slice, registered as an attention implementation). With tied embeddings the head reads the input embedding's matrix; a last pipeline
stage keeps that matrix (only it) so its head has one to read, under the same name as on the
first stage (`parallel/tied.py` keeps the two copies equal).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.model_sections import HFSection
from meshrun.models.documents import handed_on, register_hf_attention, unpack
from meshrun.models.hf_config import (
    FUSED_PARTS,
    FUSED_PROJECTIONS,
    LAYOUT_OF,
    MOE_TYPES,
    QK_NORMS,
    check_fits,
    load_hf_config,
)
from meshrun.models.hf_moe import as_stored, file_names, install_balance, register_hf_experts
from meshrun.models.hf_weights import check_shapes, load_weights, pretrained_folder, weight_index
from meshrun.models.init import seeded_normal_
from meshrun.models.moe import expert_rows, held_experts, inactive_params, sparse_mlps, with_moe_blocks
from meshrun.models.protocol import StagedModel


class LearnedPositions(nn.Module):
    """GPT-2's input: token + learned position embeddings, then dropout."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: a packed row's (B, T), restarting per document; None: 0 .. T-1."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))  # (B, T, C)


class TiedHead(nn.Module):
    """Output projection through the input embedding's matrix, held by reference (a tuple hides it
    from the module registry: the model owns that parameter once, under the embedding's name)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = (embedding,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._embedding[0].weight)  # (B, T, V)


class FusedParts(nn.Module):
    """A fused projection held as its parts, one Linear each (Phi-3's qkv_proj as q, k, v; its
    gate_up_proj as gate, up): the forward concatenates their outputs, which is the fused Linear's
    output, so transformers' forward slices it as before. A column split of each part keeps whole
    heads where one of the fused matrix would cut across q, k and v; the Hugging Face files hold
    the fused tensor (`HFCausalLM.hf_tensors` says which parts make it)."""

    def __init__(self, fused: nn.Linear, **rows: int) -> None:
        super().__init__()
        assert sum(rows.values()) == fused.out_features, (rows, fused.out_features)
        like = {"bias": fused.bias is not None, "device": fused.weight.device, "dtype": fused.weight.dtype}
        for name, size in rows.items():
            self.add_module(name, nn.Linear(fused.in_features, size, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.children()], dim=-1)


def _hold_parts(layer: Any, config: Any) -> None:
    """Phi-3's fused projections as FusedParts, rows in transformers' order: q, k, v (sized as its
    attention slices them: the config's heads and the module's kv heads), then gate and up halves."""
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = config.num_attention_heads * attn.head_dim, attn.num_key_value_heads * attn.head_dim
    attn.qkv_proj = FusedParts(attn.qkv_proj, q=q, k=kv, v=kv)
    mlp.gate_up_proj = FusedParts(mlp.gate_up_proj, gate=config.intermediate_size, up=config.intermediate_size)


class WithPositions(nn.Module):
    """A layer callable on hidden states alone (it computes its own rotary embeddings): for
    profiling the blocks one by one (`parallel.balance: time | size`)."""

    def __init__(self, layer: nn.Module, model: HFCausalLM) -> None:
        super().__init__()
        self.layer, self._model = layer, (model,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, position_embeddings=self._model[0]._position_embeddings(x))


class HFCausalLM(StagedModel):
    takes_documents = True  # packed rows: models/documents.py
    sequence_shards = 1  # hidden states hold 1/sequence_shards of the positions (models/protocol.py)
    auto_class = "AutoModelForCausalLM"  # transformers' class that builds the whole model
    head_name = "lm_head"  # the head's module in transformers' model

    def __init__(self, cfg: HFSection) -> None:
        import transformers

        super().__init__()
        check_fits(cfg)
        self.cfg, self.hf_config = cfg, self.config_of(cfg)
        self.layout = LAYOUT_OF[self.hf_config.model_type]
        self.tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        # fp32 master weights whatever the folder's storage dtype (released checkpoints say bfloat16):
        # autocast picks the compute precision, AdamW must update fp32 values
        moe = {"experts_implementation": register_hf_experts()} if self.hf_config.model_type in MOE_TYPES else {}
        hf = getattr(transformers, self.auto_class).from_config(
            self.hf_config,
            attn_implementation=register_hf_attention(),
            dtype=torch.float32,
            trust_remote_code=False,
            **moe,
        )
        self.hf_class_name = type(hf).__name__  # for export's config.json `architectures`
        self._rotary: tuple[nn.Module, ...] = ()
        if self.layout.rotary:  # llama
            base, layers = hf.model, hf.model.layers
            self.embed: nn.Module | None = base.embed_tokens
            embedding = base.embed_tokens  # the matrix a tied head reads
            self.norm: nn.Module | None = base.norm
            with torch.device("cpu"):  # real buffers even when built on meta; not registered: no state, no DDP sync
                self._rotary = (type(base.rotary_emb)(config=self.hf_config),)
        else:  # gpt2
            base, layers = hf.transformer, hf.transformer.h
            self.embed = LearnedPositions(base.wte, base.wpe, base.drop)
            embedding = base.wte
            self.norm = base.ln_f
        self.blocks = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        if self.hf_config.model_type in FUSED_PARTS:
            for layer in layers:
                _hold_parts(layer, self.hf_config)
        self.balance = install_balance(self.blocks, cfg, self.hf_config)  # MoE layers' balance loss, or None
        self.head: nn.Module | None = TiedHead(embedding) if self.tied else getattr(hf, self.head_name)

    def config_of(self, cfg: HFSection) -> Any:
        """The transformers config this model is built from (shared: load_hf_config caches it, never changed)."""
        return load_hf_config(cfg)

    @property
    def tied_weight(self) -> str | None:
        """Name of the embedding matrix the head shares, when tied (the same name on every stage)."""
        return self.layout.tied_weight if self.tied else None

    def tp_plan(self) -> dict[str, str] | None:
        """Megatron's split of transformers' own layers: q, k, v and the gated MLP's gate and up by
        columns (whole heads, whole kv heads per rank: the attention reshapes with -1 heads and a
        group ratio that the split keeps; Phi-3's fused ones by their parts, see `tp_local`), o and
        down by rows, the vocabulary in embedding and head. Qwen3's q/k norms run per head on this
        rank's heads; OLMo 2's normalise the whole projected width, so q and k are gathered for
        them and they hand on this rank's heads. Under sequence parallel the RMSNorms run on a
        rank's positions, attention and the MLP gather the whole sequence. A MoE family's sparse
        MLPs stay whole on every tp rank (models/moe.with_moe_blocks). None for GPT-2's fused
        Conv1D (refused before spawn)."""
        model_type = self.hf_config.model_type
        if model_type in FUSED_PROJECTIONS:
            return None
        whole_width = model_type in QK_NORMS and QK_NORMS[model_type] == "whole_width"
        attn, mlp = "blocks.*.self_attn.", "blocks.*.mlp."
        fused = model_type in FUSED_PARTS
        q, k, v = (f"{attn}qkv_proj.{p}" if fused else f"{attn}{p}_proj" for p in "qkv")
        gate, up = (f"{mlp}gate_up_proj.{p}" if fused else f"{mlp}{p}_proj" for p in ("gate", "up"))
        plan = {
            "embed": "vocab_embedding_scatter",
            "blocks.*.*_layernorm": "norm",  # input/post-attention (OLMo 2: post-attention/feedforward)
            "norm": "norm",
            "blocks.*.self_attn": "gather_hidden_states",
            "blocks.*.mlp": "gather",
            **{name: "colwise_gathered" if whole_width else "colwise" for name in (q, k)},
            v: "colwise",
            f"{attn}o_proj": "rowwise",
            gate: "colwise",
            up: "colwise",
            f"{mlp}down_proj": "rowwise",
            "head": "tied_vocab_head" if self.tied else "vocab_head",
        }
        if model_type in QK_NORMS:
            plan |= {f"{attn}{name}_norm": "sliced_output" if whole_width else "per_head" for name in "qk"}
        return with_moe_blocks(plan, self.blocks) if model_type in MOE_TYPES else plan

    def tp_local(self, tp: int) -> None:
        """This stage runs as one of `tp` ranks: Phi-3's attention slices its q, k, v output by the
        config's head count and its own kv head count, so each attention gets one rank's share (a
        copy of the config; the group ratio stays). The other layouts reshape with -1 heads."""
        if self.hf_config.model_type not in FUSED_PARTS or not len(self.blocks):
            return
        attentions: list[Any] = [block.self_attn for block in self.blocks.values()]  # transformers' modules
        local = copy.copy(attentions[0].config)
        local.num_attention_heads //= tp
        local.num_key_value_heads //= tp
        for attn in attentions:
            attn.config = local
            attn.num_key_value_heads //= tp

    def keep_stage(self, *, first: bool, last: bool) -> None:
        """Drop the parts another stage owns; a tied last stage keeps only the embedding matrix."""
        if not last:
            self.norm = self.head = None
        if first:
            return
        if last and self.tied:
            if isinstance(self.embed, LearnedPositions):  # gpt2: the head needs only the token matrix
                self.embed.register_module("wpe", None)
        else:
            self.embed = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Any:
        """Token ids (B, T) or hidden states (B, T, C) -> what the next stage expects (logits at the end).

        A packed batch (B, 2, T): rotary or learned positions restart at each document, and the
        layers get them as `position_ids`, which keeps attention within documents (HF_ATTENTION);
        a stage before the last hands on (hidden, positions)."""
        x, positions = unpack(x, positions)
        if self.embed is not None and not x.is_floating_point():  # hidden states: a tied last stage skips it
            x = self.embed(x) if positions is None or self._rotary else self.embed(x, positions)
        x = self.run_blocks(x, positions)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is None:
            return handed_on(x, positions)
        return self.head(x)

    def run_blocks(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers on hidden states (B, T, C), with the rotary embeddings they need (a
        packed batch's `positions` restart per document)."""
        extra: dict[str, Any] = {} if positions is None else {"position_ids": positions}
        if self._rotary and len(self.blocks):
            extra["position_embeddings"] = self._position_embeddings(x, positions)
        if self.balance is not None:
            self.balance.pending.clear()  # a recompute's routing, left by the last backward
        for block in self.blocks.values():
            x = block(x, **extra)
        return x if self.balance is None else self.balance.finish(x)

    def standalone_blocks(self) -> list[nn.Module]:
        """The blocks as modules that take hidden states only (what a profiler feeds them)."""
        return [WithPositions(b, self) if self._rotary else b for b in self.blocks.values()]

    def _position_embeddings(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of `positions` (a packed row's, (B, T)) or of 0 .. T-1, each (B or 1, T, head_dim)."""
        rotary = self._rotary[0]
        if rotary.inv_freq.device != x.device:
            rotary.to(x.device)
        if positions is None:
            # attention runs on the whole sequence even where x holds a rank's positions (sequence parallel)
            positions = torch.arange(x.shape[1] * self.sequence_shards, device=x.device).unsqueeze(0)
        return rotary(x, positions)

    def hf_names(self, name: str) -> list[str]:
        """Hugging Face keys for one of our tensor names (or a fused projection's, see `hf_tensors`), most likely first."""
        return file_names(self.layout.hf_names(name, tied=self.tied), self.hf_config.model_type)

    def hf_tensors(self, stored: Path | None = None) -> dict[str, list[torch.Tensor]]:
        """Our tensors grouped as the Hugging Face files hold them, by our name: one tensor each,
        but a fused projection's parts (their rows in order) under the fused module's name. MoE
        experts: one tensor per expert (what save_pretrained writes), or, where the folder at
        `stored` holds a layer's experts fused (transformers 5's 3-D names), as those tensors."""
        fused = {name for name, module in self.named_modules() if isinstance(module, FusedParts)}
        grouped: dict[str, list[torch.Tensor]] = {}
        for name, tensor in self.state_dict(keep_vars=True).items():
            module, _, param = name.rpartition(".")
            owner = module.rpartition(".")[0]
            grouped.setdefault(f"{owner}.{param}" if owner in fused else name, []).append(tensor)
        held = {
            f"blocks.{layer}.mlp.experts": held_experts(mlp.experts) for layer, mlp in sparse_mlps(self.blocks).items()
        }
        index = weight_index(stored) if stored is not None and held else {}
        fused_experts = {name for name in held if any(k in index for k in self.hf_names(f"{name}.gate_up_proj"))}
        return as_stored(grouped, held, fused_experts)

    def pretrained_dir(self) -> Path | None:
        """The directory whose weights this model starts from, per `model.init`."""
        return pretrained_folder(self.cfg)

    def check_weights(self) -> None:
        """Before spawning: the weights this model would load exist with the shapes config.json gives."""
        path = self.pretrained_dir()
        if path is not None:
            check_shapes(self.pretrained_tensors(path), self.hf_names, path)

    def pretrained_tensors(self, path: Path) -> dict[str, list[torch.Tensor]]:
        """The tensors loaded from the folder at `path` (`hf_tensors`' grouping as it stores them): all of them."""
        return self.hf_tensors(path)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Pretrained tensors of the parts present, or a seeded init per parameter name (layout independent)."""
        path = self.pretrained_dir()
        if path is not None:
            load_weights(self.pretrained_tensors(path), self.hf_names, path)
            return
        std = self.hf_config.initializer_range
        depth_std = std / math.sqrt(2 * self.hf_config.num_hidden_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)  # norm scales
            else:  # GPT-2 scales its residual output projections by depth, as transformers does
                std_of = depth_std if name.endswith("c_proj.weight") else std
                seeded_normal_(param, seed, name, std=std_of, rows=expert_rows(self, name))

    def flops_per_token(self, length: int | None = None) -> float:
        """Training FLOPs per token of `length`-token samples (default model.seq_len): 6 x matmul
        params (head included; MoE: active ones) + causal attention (PaLM appendix B)."""
        c = self.hf_config
        matmul = sum(p.numel() for n, p in self.named_parameters() if not n.startswith("embed."))
        matmul += c.vocab_size * c.hidden_size if self.tied else 0
        matmul -= inactive_params(self.blocks)  # MoE: the experts a token runs through only
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 6.0 * matmul + 12.0 * c.num_hidden_layers * c.num_attention_heads * head_dim * (
            length or self.cfg.seq_len
        )
