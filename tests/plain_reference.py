"""An independent training reference in plain torch, for the numerics tests.

meshrun's parity tests compare a layout with meshrun's own one-process run; a constant factor
in the gradient (a sum instead of a mean over dp ranks or microbatches) would survive that,
since every step is clipped and AdamW is scale-invariant. This reference shares with meshrun
only the model definition, its seeded initial weights and the token stream; the loss (mean
token cross-entropy over the WHOLE global batch, one backward), the optimizer groups (torch.optim's class, not fused), the
learning-rate schedule and the clipping are written here again from their definitions.
On documents (prepare-data --chat / --prompt-completion) it shares which documents a step holds
(data/packing.py, tested on its own) but runs each document alone: no packed rows, no masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from meshrun.config.schema import Config, TrainConfig, load_config
from meshrun.data.dataset import TokenDataset
from meshrun.data.packed import PackedDataset
from meshrun.data.storage import DOCUMENTS_FORMAT, read_meta
from meshrun.models.gpt import GPT


@dataclass(frozen=True)
class Reference:
    losses: list[float]  # per step, before the update
    grad_norms: list[float]  # per step, global L2 norm before clipping
    weights: dict[str, torch.Tensor]  # after the last step


def config_from_set_args(args: list[str]) -> Config:
    """The Config a `meshrun train --set=...` command line resolves to."""
    return load_config(None, [arg.removeprefix("--set=") for arg in args])


def cosine_lr(step: int, *, lr: float, warmup: int, steps: int, floor: float) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine down to `floor * lr` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def plain_optimizer(train: TrainConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """torch.optim's own class for `train.optimizer`, single-tensor (not fused) and given each option by its torch name."""
    if train.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, eps=train.eps, foreach=False)
    if train.optimizer == "adam":
        return torch.optim.Adam(groups, lr=train.lr, betas=train.betas, eps=train.eps, foreach=False)
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum, nesterov=train.nesterov, foreach=False)
    assert train.optimizer == "rmsprop"
    return torch.optim.RMSprop(
        groups, lr=train.lr, alpha=train.alpha, eps=train.eps, momentum=train.momentum, foreach=False
    )


StepLoss = Callable[[GPT, int], torch.Tensor]  # (model, step) -> that step's loss over the global batch


def token_loss(cfg: Config, data_dir: Path) -> StepLoss:
    """Mean token cross-entropy over the step's whole global batch of plain-text rows."""
    data, batch = (
        TokenDataset(data_dir, "train", seq_len=cfg.model.seq_len, seed=cfg.train.seed),
        cfg.train.global_batch,
    )

    def loss(model: GPT, step: int) -> torch.Tensor:
        x, y = data.batch(step * batch, batch)
        logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))  # mean over B*T tokens

    return loss


def documents_loss(cfg: Config, data_dir: Path) -> StepLoss:
    """Each document of the step's rows run alone (positions 0 .. n-1), the cross-entropy of the
    next tokens its loss mask trains summed over them all, / their count: the global batch's mean."""
    data, batch = (
        PackedDataset(data_dir, "train", seq_len=cfg.model.seq_len, seed=cfg.train.seed),
        cfg.train.global_batch,
    )

    def loss(model: GPT, step: int) -> torch.Tensor:
        total, count = torch.zeros(()), 0
        for row in data.rows(step * batch, batch):
            for k in row.docs.tolist():
                ids, mask = (torch.from_numpy(a) for a in data.docs.document(k))
                trained = mask[1:]  # position j predicts token j + 1
                logits = model(ids[None])[0, :-1]  # (n - 1, V)
                total = total + F.cross_entropy(logits[trained], ids[1:][trained], reduction="sum")
                count += int(trained.sum())
        return total / count

    return loss


def train_plain(cfg: Config, data_dir: Path) -> Reference:
    """fp32, one process, whole global batch per step: plain text, or documents each run alone."""
    train = cfg.train
    model = GPT(cfg.model)
    model.init_weights(train.seed)
    params = list(model.parameters())
    optimizer = plain_optimizer(
        cfg.train,
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
    )
    documents = (read_meta(data_dir) or {}).get("format") == DOCUMENTS_FORMAT
    step_loss = (documents_loss if documents else token_loss)(cfg, data_dir)
    losses, norms = [], []
    for step in range(train.steps):
        loss = step_loss(model, step)
        optimizer.zero_grad()
        loss.backward()
        clip = train.grad_clip if train.grad_clip > 0 else math.inf
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        losses.append(loss.item())
        lr = cosine_lr(step, lr=train.lr, warmup=train.warmup_steps, steps=train.steps, floor=train.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    return Reference(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()})


def assert_grad_norms_match(got: list[float], want: list[float], *, rel: float = 1e-5) -> None:
    """Every step's logged pre-clip norm equals the reference's (a factor of 2 is 100% off)."""
    assert len(got) == len(want), f"{len(got)} logged grad norms, reference has {len(want)}"
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= rel * b, f"step {step}: grad_norm {a} vs plain-torch reference {b} (ratio {a / b:.6f})"


def plain_blocks(
    w: dict[str, torch.Tensor],
    h: torch.Tensor,
    *,
    num_layers: int,
    num_heads: int,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    mlp: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """meshrun's pre-LN blocks `blocks.{i}.*` of `w` on hidden states (B, T, C), written from the
    definitions: torch's multi_head_attention_forward (masks as it takes them: True = may not
    attend), a GELU MLP (or `mlp(layer, normed states)`: a Mixture-of-Experts one), residuals; then
    the final LayerNorm `norm.*`."""
    dim = h.shape[-1]
    for i in range(num_layers):
        p = f"blocks.{i}."
        a = F.layer_norm(h, (dim,), w[p + "ln1.weight"], w[p + "ln1.bias"]).transpose(0, 1)  # (T, B, C)
        attended, _ = F.multi_head_attention_forward(
            a, a, a, dim, num_heads,
            in_proj_weight=torch.cat([w[p + f"attn.{m}.weight"] for m in "qkv"]),
            in_proj_bias=torch.cat([w[p + f"attn.{m}.bias"] for m in "qkv"]),
            bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
            out_proj_weight=w[p + "attn.proj.weight"], out_proj_bias=w[p + "attn.proj.bias"],
            training=False, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False,
        )  # fmt: skip
        h = h + attended.transpose(0, 1)
        m = F.layer_norm(h, (dim,), w[p + "ln2.weight"], w[p + "ln2.bias"])
        if mlp is not None:
            h = h + mlp(i, m)
            continue
        h = h + F.linear(
            F.gelu(F.linear(m, w[p + "mlp.fc.weight"], w[p + "mlp.fc.bias"])),
            w[p + "mlp.proj.weight"],
            w[p + "mlp.proj.bias"],
        )
    return F.layer_norm(h, (dim,), w["norm.weight"], w["norm.bias"])
