"""The built-in Mixture-of-Experts GPT: GPT's blocks whose MLP is a top-k router over gated experts,
dropless (every token reaches its k experts). No distributed code lives here.

The experts keep transformers' layout (Qwen3MoeExperts, MixtralExperts, ...): one module per layer,
`gate_up_proj` (E, 2 I, H) and `down_proj` (E, H, I), called as `experts(hidden_states, top_k_index,
top_k_weights)`, so whatever splits or dispatches transformers' experts (expert parallelism) takes
these alike. The router is `gate.weight` (E, H).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.model_sections import GPTSection, MoESection
from meshrun.models.gpt import GPT
from meshrun.models.init import seeded_normal_
from meshrun.models.moe_balance import Balance, RouterMeter

DEFAULT_COEF = 0.01  # the built-in gpt's aux_loss_coef when model.moe leaves it unset


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: it exists (torch.nn.functional.grouped_mm),
    both operands' rows are 16-byte aligned (its kernels' stride rule), and the dtype is one it
    runs: any float on the CPU, bfloat16 only on CUDA and under torch.compile (its shape rule)."""
    aligned = all(n * x.element_size() % 16 == 0 for n in weight.shape[1:])
    bf16_only = x.device.type != "cpu" or torch.compiler.is_compiling()
    dtype_ok = x.dtype == weight.dtype and (x.dtype == torch.bfloat16 or not bf16_only)
    return hasattr(F, "grouped_mm") and aligned and dtype_ok


def planned(x: torch.Tensor) -> bool:
    """Whether `x` is a fake tensor (`meshrun plan` traces a stage on them: shapes, no values).
    torch._subclasses is private: tests/models/test_moe.py checks this still answers."""
    from torch._subclasses.fake_tensor import is_fake

    return not torch.compiler.is_compiling() and is_fake(x)  # torch.compile traces on fake tensors too


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on this device type, or None where it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def autocast_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Under autocast, both operands in its dtype, as autocast casts a linear layer's: the grouped
    matmul is on none of its lists, and would otherwise run the fp32 master weights as they are
    (in fp32 on the CPU; on CUDA, which takes bf16 only, in the loop)."""
    dtype = autocast_dtype(x.device.type)
    return (x, weight) if dtype is None else (x.to(dtype), weight.to(dtype))


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of `x` (S, in; sorted by expert, `counts` (E,) rows each) times that
    expert's `weight` (E, out, in) transposed -> (S, out): one grouped matmul where torch has one
    and the shapes fit (no host sync), else a loop over the experts (reads the counts on the host).
    Traced for `meshrun plan` (no counts to read): as if every expert got S / E rows, the same
    FLOPs and saved tensors as a perfectly balanced router's."""
    if planned(x):
        pad = -x.shape[0] % weight.shape[0]
        rows = F.pad(x, (0, 0, 0, pad)).view(weight.shape[0], -1, x.shape[1])
        return torch.bmm(rows, weight.transpose(1, 2)).reshape(-1, weight.shape[1])[: x.shape[0]]
    x, weight = autocast_operands(x, weight)
    if grouped_mm_fits(x, weight):
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    pieces = x.split(counts.tolist())  # one host sync
    return torch.cat([piece @ weight[e].T for e, piece in enumerate(pieces)])


class Experts(nn.Module):
    """E gated (SwiGLU) MLPs in transformers' layout: gate_up_proj (E, 2 I, H), down_proj (E, H, I)."""

    def __init__(self, *, num_experts: int, dim: int, expert_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * expert_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, expert_dim))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """(N, H) tokens, each token's k experts (N, k) and their weights (N, k) -> (N, H): the tokens
        sorted by expert, each expert's rows through its MLP, weighted and summed back per token."""
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)  # (N k,)
        order = torch.argsort(flat, stable=True)
        token = order // k  # the token of each sorted row
        # tokens per expert, a shape known before the values (bincount's is not: the planner traces on fake tensors)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        gate, up = expert_matmul(hidden_states[token], self.gate_up_proj, counts).chunk(2, dim=-1)
        rows = expert_matmul(F.silu(gate) * up, self.down_proj, counts)  # (N k, H)
        rows = rows * top_k_weights.reshape(-1)[order, None].to(rows.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, rows.to(hidden_states.dtype))


@dataclass(frozen=True)
class HeldExperts:
    """The experts an experts module holds: `count` consecutive ones of the layer's `total`, from
    `first`. parallel.ep cuts each stage to its rank's share on the meta device (`hold_experts`), so
    materialising and loading the stage allocate and read only those."""

    first: int
    count: int
    total: int

    @classmethod
    def of_rank(cls, total: int, rank: int, ranks: int) -> HeldExperts:
        """Rank `rank` of `ranks`'s share: experts rank E/ranks .. (rank + 1) E/ranks - 1."""
        count = total // ranks
        return cls(first=rank * count, count=count, total=total)


def held_experts(module: nn.Module) -> HeldExperts:
    """What an experts module (3-D `gate_up_proj`, experts on dim 0) holds: its record, else all of them."""
    total = int(module.get_parameter("gate_up_proj").shape[0])
    return getattr(module, "held_experts", None) or HeldExperts(first=0, count=total, total=total)


def hold_experts(module: nn.Module, held: HeldExperts) -> None:
    """Keep only `held`'s experts of a whole experts module: on the meta device nothing is allocated
    (a later `to_empty` makes just these); a real module's other experts are freed."""
    for name in ("gate_up_proj", "down_proj"):
        whole = module.get_parameter(name)
        kept = whole.detach()[held.first : held.first + held.count].clone()
        setattr(module, name, nn.Parameter(kept, requires_grad=whole.requires_grad))
    if hasattr(module, "num_experts"):
        setattr(module, "num_experts", held.count)  # noqa: B010 transformers' forwards count their experts from it
    setattr(module, "held_experts", held)  # noqa: B010 (nn.Module's __setattr__ is typed for tensors and modules)


def expert_rows(model: nn.Module, name: str) -> tuple[int, int] | None:
    """(first, total) of the experts parameter `name` of `model` when its module holds a share of
    the layer's experts (`hold_experts`); None for any other parameter or whole experts."""
    owner, _, param = name.rpartition(".")
    if param not in ("gate_up_proj", "down_proj"):
        return None
    held = getattr(model.get_submodule(owner), "held_experts", None)
    return None if held is None or held.count == held.total else (held.first, held.total)


class Router(nn.Module):
    """Scores every expert for each token and keeps the top k: softmax over the experts (top-k
    weights renormalised when `norm_topk_prob`) or per-expert sigmoid (weights renormalised)."""

    def __init__(self, cfg: MoESection, dim: int) -> None:
        super().__init__()
        self.cfg, self.top_k, self.num_experts = cfg, cfg.top_k, cfg.num_experts  # as transformers' routers
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, H) -> (probabilities (N, E) fp32 for the balance loss, top-k weights (N, k), top-k experts (N, k))."""
        logits = F.linear(x, self.weight).float()
        if self.cfg.gate == "softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, chosen = torch.topk(probs, self.cfg.top_k, dim=-1)
            if self.cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            scores = torch.sigmoid(logits)
            weights, chosen = torch.topk(scores, self.cfg.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), chosen


class MoEMLP(nn.Module):
    """A block's MLP as router + experts; its output carries the balance loss's gradient (moe_balance)."""

    def __init__(self, cfg: GPTSection, layer: int, balance: Balance) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = Router(moe, cfg.dim)
        self.experts = Experts(num_experts=moe.num_experts, dim=cfg.dim, expert_dim=expert_dim(cfg))
        self.meter = RouterMeter(layer, moe.num_experts)
        self._balance = (balance,)  # shared by the model's layers, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs, weights, chosen = self.gate(flat)
        out = self.experts(flat, chosen, weights).view(b, t, h)
        return self._balance[0].layer_output(out, self.meter, probs, chosen, batch=b)


def sparse_mlps(blocks: nn.ModuleDict) -> dict[int, Any]:
    """Layer index -> the layer's MoE MLP (one with `experts` and a router `gate` that has `top_k` and
    `num_experts`: ours and transformers' alike, reached by those names: typed Any)."""
    mlps = {int(key): getattr(block, "mlp", None) for key, block in blocks.items()}  # BERT's layers have none
    return {layer: mlp for layer, mlp in mlps.items() if hasattr(mlp, "experts") and hasattr(mlp, "gate")}


def with_moe_blocks(plan: dict[str, str], blocks: nn.ModuleDict) -> dict[str, str]:
    """A dense model's tp plan for a model with MoE MLPs among `blocks` (`blocks.*.mlp` its MLPs):
    the dense blocks' MLPs split as `plan` says, each MoE MLP whole on every tp rank (style
    `moe_block`: router, experts and a shared expert plain tensors; parallel.ep splits the experts
    over dp ranks instead). Attention, the embedding and the head as `plan` says."""
    mlp = {key: style for key, style in plan.items() if key.startswith("blocks.*.mlp")}
    sparse = sparse_mlps(blocks)
    dense = [key for key in blocks if int(key) not in sparse]
    return {
        **{key: style for key, style in plan.items() if key not in mlp},
        **{key.replace("*", i, 1): style for i in dense for key, style in mlp.items()},
        **{f"blocks.{i}.mlp": "moe_block" for i in sparse},
    }


def moe_layers(blocks: nn.ModuleDict) -> dict[int, int]:
    """Layer index -> its experts, for the MoE layers among `blocks`."""
    return {layer: int(mlp.gate.num_experts) for layer, mlp in sparse_mlps(blocks).items()}


def inactive_params(blocks: nn.ModuleDict) -> float:
    """The expert parameters a token does not run through: each MoE layer's experts x (1 - k / E).
    Training FLOPs count 6 x the active parameters (total - these): what MFU divides by."""
    inactive = 0.0
    for mlp in sparse_mlps(blocks).values():
        share = 1 - mlp.gate.top_k / mlp.gate.num_experts
        inactive += share * sum(p.numel() for p in mlp.experts.parameters())
    return inactive


def expert_dim(cfg: GPTSection) -> int:
    """An expert's hidden width: model.moe.expert_dim, else the dense MLP's 4 x dim shared by the top k."""
    assert cfg.moe is not None
    return cfg.moe.expert_dim or max(1, 4 * cfg.dim // cfg.moe.top_k)


def sparse_layers(num_layers: int, every: int) -> list[int]:
    """The blocks that hold experts: every n-th, counted from 1 (Qwen's decoder_sparse_step)."""
    return [i for i in range(num_layers) if (i + 1) % every == 0]


class MoEGPT(GPT):
    """GPT with MoE MLPs in the blocks `sparse_every` names."""

    def __init__(self, cfg: GPTSection) -> None:
        super().__init__(cfg)
        moe = cfg.moe
        assert moe is not None
        self.moe_layers = sparse_layers(cfg.num_layers, moe.sparse_every)
        coef = DEFAULT_COEF if moe.aux_loss_coef is None else moe.aux_loss_coef
        self.balance = Balance(moe.aux_loss, coef, len(self.moe_layers))
        for i in self.moe_layers:
            self.blocks[str(i)].mlp = MoEMLP(cfg, i, self.balance)

    def tp_plan(self) -> dict[str, str]:
        """GPT's split, its MoE MLPs whole on every tp rank (`with_moe_blocks`)."""
        return with_moe_blocks(super().tp_plan(), self.blocks)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> object:
        """GPT's forward; the microbatch form's balance loss rides on what the blocks return (one stage)."""
        self.balance.pending.clear()  # a recompute's routing, left by the last backward
        out = super().forward(x, positions)
        if self.balance.pending and isinstance(out, torch.Tensor):
            return self.balance.finish(out)
        return out

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT's init, then the routers and experts from their own (seed, name) streams: normal(0.02),
        the down projections depth-scaled as GPT's residual projections (a rank's share of the
        experts: its rows of the whole layer's draw)."""
        super().init_weights(seed)
        depth_std = 0.02 / (2 * self.cfg.num_layers) ** 0.5
        for name, param in self.named_parameters():
            if name.endswith("mlp.gate.weight"):
                seeded_normal_(param, seed, name, std=0.02)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                std = 0.02 if name.endswith("gate_up_proj") else depth_std
                seeded_normal_(param, seed, name, std=std, rows=expert_rows(self, name))

    def flops_per_token(self, length: int | None = None) -> float:
        """GPT's count with only the active experts' weights: each MoE layer's experts count top_k / E
        of their parameters (a token runs through k of E experts); the routers count whole."""
        return super().flops_per_token(length) - 6.0 * inactive_params(self.blocks)
