"""Hugging Face Mixture-of-Experts layers (qwen3_moe, qwen2_moe, mixtral, olmoe) as transformers
builds them, with meshrun's balance loss and routing meters hooked on, and their experts named as
the model files hold them. No distributed code lives here.

transformers 5 keeps a layer's experts as one module, `mlp.experts` (3-D `gate_up_proj` (E, 2 I, H),
`down_proj` (E, H, I)), and its router as `mlp.gate` (returning logits, top-k weights, top-k
experts); the files hold one tensor per expert (`experts.{e}.gate_proj.weight`, ...; Mixtral's
`block_sparse_moe.experts.{e}.w1/w3/w2.weight`), which transformers' loading merges (its
conversion_mapping: MergeModulelist, then gate and up concatenated), or, written from a transformers
5 state dict, the 3-D tensors under the module's own names, which it loads as they are. A stage
cut to one ep rank's experts (models/moe.HeldExperts) reads only those: its experts' own tensors,
or their rows of a 3-D one (`safe_open(...).get_slice`). A layer is sparse where transformers made it so
(Qwen's decoder_sparse_step and mlp_only_layers): whichever layers have `mlp.experts`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshrun.config.model_sections import HFSection
from meshrun.errors import ConfigError
from meshrun.models.hf_weights import elsewhere
from meshrun.models.moe import HeldExperts, autocast_dtype, sparse_mlps
from meshrun.models.moe_balance import Balance, RouterMeter

HF_EXPERTS = "meshrun_grouped_mm"  # the experts implementation meshrun builds MoE families with

_MIXTRAL = (  # transformers 5's names -> Mixtral's files' names
    (re.compile(r"\.mlp\.experts\.(\d+)\.gate_proj\."), r".block_sparse_moe.experts.\1.w1."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.up_proj\."), r".block_sparse_moe.experts.\1.w3."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.down_proj\."), r".block_sparse_moe.experts.\1.w2."),
    (re.compile(r"\.mlp\.gate\."), ".block_sparse_moe.gate."),
    (re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$"), r".block_sparse_moe.experts.\1"),  # fused
)


def register_hf_experts() -> str:
    """Make `experts_forward` known to transformers as HF_EXPERTS (idempotent); returns its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(HF_EXPERTS, experts_forward)
    return HF_EXPERTS


def experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' grouped experts forward with operands in the dtype the step computes in. Its
    grouped matmul is on none of autocast's lists and runs the fp32 master weights as they are (on
    CUDA it takes bf16 only, so a bf16 run would stop); under autocast the weights and the tokens
    are cast to autocast's dtype, as a linear layer's would be. Without autocast, weights other
    than bf16 on a GPU take transformers' loop over the experts."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    device = hidden_states.device.type
    if (dtype := autocast_dtype(device)) is not None:
        with weights_as(module, dtype):
            return grouped_mm_experts_forward(module, hidden_states.to(dtype), top_k_index, top_k_weights)
    if device != "cpu" and any(p.dtype != torch.bfloat16 for p in module.parameters(recurse=False)):
        loop = type(module).forward.__wrapped__  # the family's own forward, under transformers' dispatch
        return loop(module, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


@contextlib.contextmanager
def weights_as(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """The module's own parameters read as `dtype` copies (differentiable) while the block runs."""
    held = dict(module._parameters)
    try:
        for name, param in held.items():
            if param is not None:
                module._parameters[name] = param.to(dtype)  # type: ignore[assignment]  # a view autograd follows back
        yield
    finally:
        module._parameters.update(held)


def install_balance(blocks: nn.ModuleDict, cfg: HFSection, config: Any) -> Balance | None:
    """Hooks on every sparse layer: its router's output is kept, its output carries the balance
    loss's gradient and records the routing (`RouterMeter` as `mlp.meter`). None without MoE layers
    (model.moe is then refused: it would configure nothing)."""
    mlps = sparse_mlps(blocks)
    if not mlps:
        if cfg.moe is not None:
            raise ConfigError(
                f"model.moe sets a balance loss, but the model ({config.model_type}) has no MoE layers; remove model.moe"
            )
        return None
    gate = next(iter(mlps.values())).gate
    if gate.top_k > gate.num_experts:  # torch.topk would fail in every worker
        raise ConfigError(
            f"the model's num_experts_per_tok ({gate.top_k}) exceeds its experts ({gate.num_experts}); lower it in its config"
        )
    moe = cfg.moe
    coef = config.router_aux_loss_coef if moe is None or moe.aux_loss_coef is None else moe.aux_loss_coef
    balance = Balance("sequence" if moe is None else moe.aux_loss, coef, len(mlps))
    for layer, mlp in mlps.items():
        mlp.meter = RouterMeter(layer, mlp.gate.num_experts)
        routed: list[tuple[torch.Tensor, torch.Tensor]] = []

        def keep(_gate: nn.Module, _args: Any, output: Any, routed: list = routed) -> None:
            logits, _, chosen = output
            routed[:] = [(torch.softmax(logits.float(), dim=-1), chosen)]

        def attach(mlp: Any, args: Any, output: torch.Tensor, routed: list = routed) -> torch.Tensor:
            ((probs, chosen),) = routed
            routed.clear()
            return balance.layer_output(output, mlp.meter, probs, chosen, batch=args[0].shape[0])

        mlp.gate.register_forward_hook(keep)
        mlp.register_forward_hook(attach)
    return balance


def as_stored(
    grouped: dict[str, list[torch.Tensor]], held: dict[str, HeldExperts], fused: set[str]
) -> dict[str, list[torch.Tensor]]:
    """`hf_tensors`' grouping with each experts module's 3-D tensors (by module name in `held`, with
    the experts it holds) as the files hold them. Per expert (what save_pretrained writes): one view
    per held expert and projection, named by its index in the layer (`experts.{e}.gate_proj.weight`
    the first I rows of gate_up_proj[e], `up_proj` the rest, `down_proj` down_proj[e]), so loading
    writes into the parameter, reads no other expert's tensors, and export writes the files' form.
    A module in `fused` (the files hold its 3-D tensors): the parameter as the rows `first ..` of
    the file tensor, the other experts' rows as meta placeholders, never read (hf_weights)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, parts in grouped.items():
        prefix, _, param = name.rpartition(".")
        if prefix not in held or param not in ("gate_up_proj", "down_proj"):
            out[name] = parts
            continue
        (tensor,) = parts
        rows = held[prefix]
        if prefix in fused:
            before, after = rows.first, rows.total - rows.first - rows.count
            out[name] = [elsewhere(before, tensor), tensor, elsewhere(after, tensor)]
            continue
        for local in range(tensor.shape[0]):
            e = rows.first + local
            if param == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = [tensor[local]]
            else:
                gate, up = tensor[local].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = [gate]
                out[f"{prefix}.{e}.up_proj.weight"] = [up]
    return out


def file_names(keys: list[str], model_type: str) -> list[str]:
    """The Hugging Face keys to try for one tensor: Mixtral's files name its MoE block differently."""
    if model_type != "mixtral":
        return keys
    renamed = []
    for key in keys:
        for pattern, replacement in _MIXTRAL:
            key = pattern.sub(replacement, key)
        renamed.append(key)
    return list(dict.fromkeys(renamed + keys))
