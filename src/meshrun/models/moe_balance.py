"""The routers' load-balancing loss, how its gradient reaches every router on every layout, and the
routing figures of a log window. No distributed code lives here beyond the window's one all-reduce.

Two forms (`model.moe.aux_loss`):

- `sequence` (the default; DeepSeek-V3's sequence-wise balance loss at transformers' scale): for
  each MoE layer l and each sequence s of T tokens, L(l, s) = E x sum_e f(s, e) P(s, e), f the
  fraction of the sequence's tokens that chose expert e among their top k (summing to k), P the
  sequence's mean router probability of e. The loss is coef x the mean of L over the MoE layers
  and over the sequences of the GLOBAL batch: every sequence weighs the same whichever rank,
  microbatch or stage routes it, so its value and gradient do not depend on the layout.
- `microbatch`: transformers' `load_balancing_loss_func` (Switch Transformer's batch-level form)
  over every MoE layer of one microbatch (f and P pooled over its layers and tokens), coef x its
  mean over the global batch's microbatches. Its expert fractions are counted over whichever
  tokens share a microbatch, so it depends on `train.micro_batch` (and needs every MoE layer on one
  pipeline stage). It is what transformers computes with `output_router_logits`.

No stage but the last returns anything beside its activations, so the loss is not added to the
language loss: the MoE layer's output passes through `_AddAuxGradient` (Megatron's
MoEAuxLossAutoScaler), whose backward hands the aux loss its gradient, d(step loss)/d(aux), from
the step's `aux_gradient` scale. The same backward records the layer's routing (tokens per expert,
the loss's value) in its `RouterMeter`: once per microbatch, also under activation recompute.

Where parallel.ep spans tp, each tp rank routes its own positions of every sequence (`split_over`):
the expert counts the loss needs are summed over those ranks (the one collective here besides the
window's), each rank's loss is its share, and the meters count each rank's own tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

AUX_LOSSES = ("sequence", "microbatch", "none")


@dataclass
class RouterMeter:
    """One MoE layer's routing over a log window (on this rank): tokens per expert, and the balance
    loss's summed value with the count it averages over. A plain object, not a buffer: no checkpoint
    or DDP broadcast sees it."""

    layer: int
    num_experts: int
    counts: torch.Tensor | None = None
    aux_sum: float | torch.Tensor = 0.0
    aux_count: float = 0.0

    def record(self, counts: torch.Tensor, aux: torch.Tensor | None, aux_count: float) -> None:
        if not _RECORDING[-1]:  # a pipeline stage's shape inference: a backward on uninitialised tensors
            return
        self.counts = counts if self.counts is None else self.counts + counts
        if aux is not None:
            self.aux_sum = self.aux_sum + aux
            self.aux_count += aux_count

    def take(self, device: torch.device) -> torch.Tensor:
        """[counts..., aux sum, aux count] (float64) and a fresh window."""
        counts = torch.zeros(self.num_experts, dtype=torch.float64, device=device)
        if self.counts is not None:
            counts += self.counts.to(device, torch.float64)
        aux = torch.as_tensor(self.aux_sum, dtype=torch.float64, device=device).reshape(1)
        taken = torch.cat([counts, aux, torch.tensor([self.aux_count], dtype=torch.float64, device=device)])
        self.counts, self.aux_sum, self.aux_count = None, 0.0, 0.0
        return taken


@dataclass(frozen=True)
class _Step:
    """d(step loss)/d(aux) per form: the loss is normalised once for the global batch (training/loss.py)."""

    per_sequence: float | torch.Tensor | None = None
    per_microbatch: float | torch.Tensor | None = None


_STEP: list[_Step] = [_Step()]
_RECORDING: list[bool] = [True]


@contextlib.contextmanager
def routing_recorded(on: bool) -> Iterator[None]:
    """Whether the backwards run inside count into the router meters: a pipeline schedule turns
    them off for its step and on for each stage's real backward (its first step also infers the
    stages' shapes with a forward and backward of uninitialised tensors, which must not count)."""
    _RECORDING.append(on)
    try:
        yield
    finally:
        _RECORDING.pop()


@contextlib.contextmanager
def aux_gradient(*, sequences_per_rank: float, microbatches: int, grad_scale: torch.Tensor | None) -> Iterator[None]:
    """The scale of the aux loss's gradient during one training step's forward and backward: the
    per-sequence sums are divided by the global batch's sequences / dp, a microbatch's loss by the
    rank's microbatches (DDP and FSDP then average over dp: the global batch's mean); fp16: times
    the loss scale. Outside (a profiler's backward): each forward's own mean."""
    scale: float | torch.Tensor = 1.0 if grad_scale is None else grad_scale
    _STEP.append(_Step(per_sequence=scale / sequences_per_rank, per_microbatch=scale / microbatches))
    try:
        yield
    finally:
        _STEP.pop()


class _AddAuxGradient(torch.autograd.Function):
    """Identity on the hidden states; backward gives `aux` (a layer's summed balance loss, coef
    included) its gradient from the step's scale, and records the routing once."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, aux: torch.Tensor, form: str, records: list, count: float) -> Any:
        ctx.form, ctx.records, ctx.count = form, records, count
        return hidden  # as is (Megatron's): only the backward differs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        for meter, counts, value, count in ctx.records:
            meter.record(counts, value, count)
        if not ctx.needs_input_grad[1]:
            return grad, None, None, None, None
        step = _STEP[-1]
        scale = step.per_sequence if ctx.form == "sequence" else step.per_microbatch
        if scale is None:  # outside a training step: this forward's own mean
            scale = 1.0 / ctx.count
        return grad, torch.ones((), device=grad.device, dtype=torch.float32) * scale, None, None, None


def expert_counts(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(..., k) chosen experts -> tokens per expert (E,), float32, on the device (no host sync)."""
    flat = chosen.reshape(-1)
    return torch.zeros(num_experts, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )


def sequence_balance(
    probs: torch.Tensor, chosen: torch.Tensor, batch: int, split_over: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-sequence balance loss L(s) = E x sum_e f(s, e) P(s, e), (B,). `probs` (B*T, E) the router's
    probabilities, `chosen` (B*T, k) the experts each token chose. `split_over`: the ranks that hold the
    sequences' other positions (Balance.split_over); f is counted over all of them, P summed over this
    rank's, so this rank's share of L, whose sum over them is L and whose gradient is this rank's part."""
    num_experts = probs.shape[-1]
    p = probs.float().reshape(batch, -1, num_experts)  # (B, T, E)
    picks = chosen.reshape(batch, -1)  # (B, T*k)
    counts = torch.zeros(batch, num_experts, device=p.device).scatter_add_(
        1, picks, torch.ones_like(picks, dtype=torch.float32)
    )
    if split_over is None:
        return num_experts * (counts / p.shape[1] * p.mean(dim=1)).sum(dim=1)  # f (B, E) sums to k
    dist.all_reduce(counts, group=split_over)
    length = p.shape[1] * dist.get_world_size(split_over)
    return num_experts * (counts / length * (p.sum(dim=1) / length)).sum(dim=1)


def microbatch_balance(
    probs: list[torch.Tensor], chosen: list[torch.Tensor], split_over: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """transformers' load_balancing_loss_func (no attention mask) over every MoE layer of one
    microbatch: fractions and probabilities pooled over the layers' tokens, sum(f x P) x E (this
    rank's share under `split_over`, as `sequence_balance`)."""
    num_experts = probs[0].shape[-1]
    counts = sum(expert_counts(c, num_experts) for c in chosen)
    prob_sum = sum(p.float().sum(dim=0) for p in probs)
    rows = torch.tensor(float(sum(p.shape[0] for p in probs)), device=probs[0].device)
    assert isinstance(counts, torch.Tensor) and isinstance(prob_sum, torch.Tensor)
    if split_over is not None:
        pooled = torch.cat([counts, rows.reshape(1)])
        dist.all_reduce(pooled, group=split_over)
        counts, rows = pooled[:-1], pooled[-1]
    return (counts / rows * (prob_sum / rows)).sum() * num_experts


@dataclass
class Balance:
    """The balance loss of a model's MoE layers (one per model or pipeline stage): what each layer
    adds to its output, per `form`; the `microbatch` form's layers are pooled by `finish`."""

    form: str
    coef: float
    num_moe_layers: int
    pending: list[tuple[RouterMeter, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # the ranks a layer's sequences are split over by position (parallel.ep spanning tp: each tp rank routes
    # its own positions; parallel/experts.py sets it): the counts the loss needs are summed over them
    split_over: dist.ProcessGroup | None = None

    @property
    def _shares(self) -> int:
        """Ranks holding a part of each sequence: each records that share of the sequences it counts."""
        return 1 if self.split_over is None else dist.get_world_size(self.split_over)

    def layer_output(
        self, out: torch.Tensor, meter: RouterMeter, probs: torch.Tensor, chosen: torch.Tensor, *, batch: int
    ) -> torch.Tensor:
        """A MoE layer's output (B, T, H), carrying its balance loss's gradient (sequence form) or
        keeping the layer's routing for `finish` (microbatch form)."""
        if self.form == "microbatch" and torch.is_grad_enabled():
            self.pending.append((meter, probs, chosen))
            return out
        counts = expert_counts(chosen.detach(), meter.num_experts)
        if self.form != "sequence" or not torch.is_grad_enabled():
            return _AddAuxGradient.apply(out, torch.zeros(()), "none", [(meter, counts, None, 0.0)], 1.0)
        losses = sequence_balance(probs, chosen, batch, self.split_over)  # (B,)
        total = losses.sum()
        aux = total * (self.coef / self.num_moe_layers)
        records = [(meter, counts, total.detach(), batch / self._shares)]
        return _AddAuxGradient.apply(out, aux, "sequence", records, float(batch))

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """After a microbatch's last MoE layer (microbatch form): transformers' batch-level loss over
        the layers routed since, its gradient carried by `hidden`."""
        if not self.pending:
            return hidden
        meters, probs, chosen = zip(*self.pending, strict=True)
        self.pending = []
        value = microbatch_balance(list(probs), list(chosen), self.split_over)
        records: list[tuple[RouterMeter, torch.Tensor, torch.Tensor | None, float]] = [
            (m, expert_counts(c.detach(), m.num_experts), None, 0.0) for m, c in zip(meters, chosen, strict=True)
        ]
        records[-1] = (*records[-1][:2], value.detach(), 1.0 / self._shares)
        return _AddAuxGradient.apply(hidden, value * self.coef, "microbatch", records, 1.0)


def meters_of(module: nn.Module) -> list[RouterMeter]:
    """The router meters of a model or stage's MoE layers (each module that holds one as `meter`)."""
    found = (getattr(m, "meter", None) for m in module.modules())
    return [meter for meter in found if isinstance(meter, RouterMeter)]


def window_row(
    parts: Sequence[nn.Module], moe_layers: dict[int, int], device: torch.device, *, copies: int = 1
) -> dict[str, float]:
    """Collective (every rank, at a log step): the log window's routing, summed over the ranks:
    `aux_loss` (the balance loss's mean, coef excluded) and per MoE layer the tokens per expert's
    min, max and coefficient of variation (std / mean). `moe_layers`: layer -> experts, whole model;
    `copies`: the ranks that route each token alike (a tp group's), counted once."""
    if not moe_layers:
        return {}
    held = {m.layer: m for part in parts for m in meters_of(part)}
    rows = []
    for layer, experts in sorted(moe_layers.items()):
        meter = held.get(layer)
        rows.append(
            meter.take(device) if meter is not None else torch.zeros(experts + 2, dtype=torch.float64, device=device)
        )
    summed = torch.cat(rows)
    if dist.is_initialized():
        dist.all_reduce(summed)
    summed /= copies
    row: dict[str, float] = {}
    at, aux_sum, aux_count = 0, 0.0, 0.0
    for layer, experts in sorted(moe_layers.items()):
        counts = summed[at : at + experts]
        aux_sum, aux_count = aux_sum + summed[at + experts].item(), aux_count + summed[at + experts + 1].item()
        at += experts + 2
        mean = counts.mean().item()
        cv = counts.std(unbiased=False).item() / mean if mean > 0 else float("nan")
        row |= {
            f"moe/layer{layer}/tokens_min": counts.min().item(),
            f"moe/layer{layer}/tokens_max": counts.max().item(),
            f"moe/layer{layer}/tokens_cv": cv,
        }
    if aux_count:
        row["aux_loss"] = aux_sum / aux_count
    return row
