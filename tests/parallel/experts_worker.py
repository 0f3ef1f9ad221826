"""One torchrun worker of tests/parallel/test_experts.py (4 ranks, gloo): transformers' own
Qwen3-MoE sparse block, whole on every rank (the one-process reference on the global batch), then
split over ep 2 (ep_dp 2) and ep 4 (ep_dp 1) with each dp rank on its share of the batch, and over ep 2
with its experts fully_shard-ed over ep_dp 2 as dp_mode fsdp does (parallel/fsdp.py); a broken
variant that returns the experts' outputs to the wrong rows; checkpoints saved at ep 2 and read at
ep 1 and ep 4; at dp 2 x tp 2 with ep 4 spanning tp (each tp rank routing its own positions, with and
without sequence parallel) and its two broken variants (the router's gradient not summed over tp,
every tp rank routing all the tokens). Writes what it measured to OUT/rank-R.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from meshrun.config.schema import TrainConfig
from meshrun.launcher.lifetime import end_worker
from meshrun.parallel import expert_shards, experts, fsdp
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import Mesh, mesh_on
from meshrun.parallel.tp_styles import TP_STYLES
from meshrun.training.optim import Optimizers

BATCH, SEQ, HIDDEN = 8, 5, 16
CONFIG = Qwen3MoeConfig(
    hidden_size=HIDDEN, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
)


def moe_block(seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    """The same weights on every rank (the router's start at zero in transformers: drawn here)."""
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(CONFIG)
    for param in block.parameters():
        nn.init.normal_(param, std=0.5)
    block.gate.register_forward_hook(_keep_choices)
    return block


def _keep_choices(gate: nn.Module, _args: tuple, out: tuple[torch.Tensor, ...]) -> None:
    """The router's last top-k experts, [tokens, k], kept on it: the per-token routing each test compares."""
    gate.choices = out[-1].detach()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=generator), torch.randn(BATCH, SEQ, HIDDEN, generator=generator)


def loss_of(out: torch.Tensor, target: torch.Tensor, *, dp: int) -> torch.Tensor:
    """Sum over this rank's tokens / the global count, times dp: DDP's mean over dp is the global mean."""
    return (out - target).pow(2).sum() * dp / (BATCH * SEQ)


def step(
    block: nn.Module,
    mesh: Mesh,
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    gradients: experts.ExpertGradients | None = None,
) -> tuple[torch.Tensor, float]:
    """Forward and backward of this dp rank's samples (`x`, `target`: theirs); gradients reduced as the trainer does."""
    out = block(x)
    loss_of(out, target, dp=mesh.size("dp")).backward()
    gradients = gradients or experts.ExpertGradients([block], mesh)
    for param in gradients.dense(list(block.parameters())):  # DDP's mean over dp
        dist.all_reduce(param.grad, group=mesh.group("dp"))
        param.grad /= mesh.size("dp")
    gradients.sync_gradients()
    dense = torch.nn.utils.get_total_norm([p.grad for p in gradients.dense(list(block.parameters()))]) ** 2
    squared = gradients.squared_norm()
    return out.detach(), float((dense + (0 if squared is None else squared)).sqrt())


def differences(
    block: nn.Module,
    reference: nn.Module,
    out: torch.Tensor,
    full_out: torch.Tensor,
    at: tuple[slice, slice],
    routed: tuple[slice, slice] | None = None,
) -> dict[str, float]:
    """Largest differences from the reference: output rows (`at`: this rank's samples and positions of
    the whole batch), router and expert gradients (this rank's experts), and `misrouted`: the tokens
    this rank routed (`routed`, by default `at`) whose chosen experts differ from the reference's."""
    shard = block.experts.expert_shard
    kept = slice(shard.first, shard.first + shard.count)
    found = {"output": (out - full_out[at]).abs().max().item()}
    expected = reference.gate.choices.view(*full_out.shape[:2], -1)[routed or at].reshape(
        -1, CONFIG.num_experts_per_tok
    )
    chosen, expected = block.gate.choices.sort(-1).values, expected.sort(-1).values
    mismatched = len(chosen) if chosen.shape != expected.shape else (chosen != expected).any(-1).sum().item()
    found["misrouted"] = float(mismatched)
    found["router_grad"] = (block.gate.weight.grad - reference.gate.weight.grad).abs().max().item()
    for name in expert_shards.EXPERT_WEIGHTS:
        mine, whole = block.experts.get_parameter(name).grad, reference.experts.get_parameter(name).grad
        mine = mine.full_tensor() if isinstance(mine, DTensor) else mine  # fsdp: sharded over ep_dp
        found[f"{name}_grad"] = (mine - whole[kept]).abs().max().item()
    return found


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, cpu = dist.get_rank(), torch.device("cpu")
    x, target = data()
    reference = moe_block()
    full_out = reference(x)
    loss_of(full_out, target, dp=1).backward()
    reference_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    found: dict[str, object] = {"reference_norm": reference_norm}
    for ep in (2, 4):
        mesh = mesh_on(Layout(dp_replicate=4, ep=ep), cpu)
        block = moe_block()
        experts.shard_experts(block, mesh)
        rows = mesh.data_shard(BATCH)
        out, norm = step(block, mesh, x[rows.start : rows.stop], target[rows.start : rows.stop])
        at = (slice(rows.start, rows.stop), slice(None))
        found[f"ep{ep}"] = {**differences(block, reference, out, full_out.detach(), at), "norm": norm}
        found[f"ep{ep}_groups"] = {name: dist.get_process_group_ranks(mesh.group(name)) for name in ("ep", "ep_dp")}
        if ep == 2:
            found["broken"] = broken_output(mesh, x, full_out)
            dcp.save(expert_shards.global_state(block, block.state_dict()), checkpoint_id=out_dir / "ep2")
    found["fsdp_ep2"] = sharded_over_ep_dp(reference, x, target, full_out)
    for variant in ("plain", "sequence", "router_not_summed", "tokens_not_split"):
        found[f"over_tp_{variant}"] = over_tp(x, target, variant)
    found["resumed"] = resumed(out_dir / "ep2", reference, cpu)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def sharded_over_ep_dp(reference: nn.Module, x: torch.Tensor, target: torch.Tensor, full_out: torch.Tensor) -> dict:
    """ep 2 under fsdp: the experts fully_shard-ed over ep_dp by fsdp.wrap_experts (the router left to
    `step`'s all-reduce); their differences from the reference and how each expert weight is laid out."""
    mesh = mesh_on(Layout(dp_shard=4, ep=2), torch.device("cpu"))
    block = moe_block()
    experts.shard_experts(block, mesh)
    options = {"mesh": mesh.data_mesh, "reshard_after_forward": True, "mp_policy": MixedPrecisionPolicy()}
    assert not fsdp.wrap_experts(block, mesh, options)  # none left out at ep_dp 2
    rows = mesh.data_shard(BATCH)
    out, norm = step(block, mesh, x[rows.start : rows.stop], target[rows.start : rows.stop])
    layouts = {}
    for name in expert_shards.EXPERT_WEIGHTS:
        param = block.experts.get_parameter(name)
        layouts[name] = [
            param.device_mesh.mesh_dim_names,
            [str(p) for p in param.placements],
            list(param.to_local().shape),
        ]
    found = differences(block, reference, out, full_out.detach(), (slice(rows.start, rows.stop), slice(None)))
    return {**found, "norm": norm, "layouts": layouts, "fp16_scales": fp16_scales(block)}


def over_tp(x: torch.Tensor, target: torch.Tensor, variant: str) -> dict[str, float]:
    """dp 2 x tp 2 with ep 4 spanning tp, the block styled `moe_block` as tensor.py applies it there:
    without sequence parallel (`plain`: the dp rank's batch replicated, this rank's positions routed,
    the output gathered), under it (`sequence`: this rank's positions in and out), and broken: the
    routers' gradients left unsummed over tp, or every tp rank routing all positions (no TokenShare).
    Differences from the whole block on the whole batch (its first 4 positions: tp divides them), the
    input's gradient too (the share's backward gathers it)."""
    x, target = x[:, :4], target[:, :4]
    reference, whole = moe_block(), x.clone().requires_grad_()
    full_out = reference(whole)
    loss_of(full_out, target, dp=1).backward()
    mesh = mesh_on(Layout(dp_replicate=2, tp=2, ep=4), torch.device("cpu"))
    tp_rank, sequence = mesh.coordinates.tp, variant == "sequence"
    block = moe_block()
    experts.shard_experts(block, mesh)
    if variant != "tokens_not_split" and (style := TP_STYLES["moe_block"].form(sequence, experts_over_tp=True).make):
        parallelize_module(block, mesh.view("tp"), style())
    rows = mesh.data_shard(BATCH)
    mine = slice(tp_rank * 2, tp_rank * 2 + 2) if sequence else slice(None)  # what it takes and hands on
    ours = x[rows.start : rows.stop, mine].clone().requires_grad_()
    gradients = experts.ExpertGradients([block], mesh)
    if variant == "router_not_summed":
        gradients.tp_group = None
    out, norm = step(block, mesh, ours, target[rows.start : rows.stop, mine], gradients=gradients)
    assert whole.grad is not None and ours.grad is not None
    samples, positions = slice(rows.start, rows.stop), slice(tp_rank * 2, tp_rank * 2 + 2)
    found = differences(block, reference, out, full_out.detach(), (samples, mine), (samples, positions))
    input_grad = (ours.grad / mesh.size("dp") - whole.grad[rows.start : rows.stop, mine]).abs().max().item()
    reference_norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    return {**found, "input_grad": input_grad, "norm": norm, "reference_norm": reference_norm}


def fp16_scales(block: nn.Module) -> list[float]:
    """fp16's loss scaler over the experts sharded over ep_dp beside the router (plain here; over dp in
    training): gradients scaled by 1024 and unscaled back by `Optimizers.unscale_` (the scale kept),
    then an inf in one rank's expert shard: every rank halves its scale. Returns the two scales."""
    before = [fsdp.local(p.grad).clone() for p in block.parameters()]
    scaler = ShardedGradScaler("cpu", init_scale=1024.0, process_group=dist.group.WORLD)
    scaler.scale(torch.zeros(()))
    optimizers = Optimizers([block], TrainConfig())
    for param in block.parameters():
        fsdp.local(param.grad).mul_(1024.0)
    optimizers.unscale_(scaler)
    scaler.update()
    assert all(torch.equal(fsdp.local(p.grad), b) for p, b in zip(block.parameters(), before))
    scales = [scaler.get_scale()]
    if dist.get_rank() == 3:
        fsdp.local(block.experts.down_proj.grad)[0, 0, 0] = float("inf")
    optimizers.unscale_(scaler)
    scaler.update()
    return [*scales, scaler.get_scale()]


def broken_output(mesh: Mesh, x: torch.Tensor, full_out: torch.Tensor) -> float:
    """ep 2 with the experts' outputs handed back in the wrong order (the combine's rows reversed):
    the test's check must see it."""
    exchange = experts.all_to_all_single_autograd
    calls = iter(range(1_000))

    def misrouted(rows: torch.Tensor, *args: object) -> torch.Tensor:
        out = exchange(rows, *args)
        return out.flip(0) if next(calls) % 2 else out  # every second exchange is the combine

    experts.all_to_all_single_autograd = misrouted
    try:
        block = moe_block()
        experts.shard_experts(block, mesh)
        rows = mesh.data_shard(BATCH)
        with torch.no_grad():
            return (block(x[rows.start : rows.stop]) - full_out[rows.start : rows.stop]).abs().max().item()
    finally:
        experts.all_to_all_single_autograd = exchange


def resumed(path: Path, reference: nn.Module, cpu: torch.device) -> dict[str, float]:
    """The ep 2 checkpoint read at ep 1 (whole experts) and at ep 4: largest difference from the
    reference's weights (every rank saved the same starting weights, so they are the reference's)."""
    found = {}
    whole = moe_block(seed=7)
    state = whole.state_dict()
    dcp.load(state, checkpoint_id=path)
    whole.load_state_dict(state)
    found["ep1"] = max((whole.get_parameter(n) - p).abs().max().item() for n, p in reference.named_parameters())
    mesh = mesh_on(Layout(dp_replicate=4, ep=4), cpu)
    quarter = moe_block(seed=7)
    experts.shard_experts(quarter, mesh)
    state = expert_shards.global_state(quarter, quarter.state_dict())
    dcp.load(state, checkpoint_id=path)
    quarter.load_state_dict(expert_shards.local_state(state))
    shard = quarter.experts.expert_shard
    kept = slice(shard.first, shard.first + shard.count)
    found["ep4"] = max(
        (quarter.experts.get_parameter(n) - reference.experts.get_parameter(n)[kept]).abs().max().item()
        for n in expert_shards.EXPERT_WEIGHTS
    )
    return found


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_worker(0)  # as meshrun's workers end: gloo can abort a finished process at finalization
