"""`meshrun plan` with a Mixture-of-Experts model: it enumerates parallel.ep, prices the all-to-alls
and the experts' gradient sum with the link and per-message cost dp and tp collectives use, splits the
experts' state over ep, computes at active parameters and says what it assumes of routing (the memory
against a real ep2 step: test_memory_model.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import meshrun_in_process, tiny

from meshrun.config.schema import Config
from meshrun.models.families import build_model, flops_at
from meshrun.planner.cost import Efficiency, Hardware
from meshrun.planner.layout_memory import layout_memory
from meshrun.planner.search import predict

MOE = {"num_experts": 4, "top_k": 2, "expert_dim": 64}
MODEL = {"vocab_size": 256, "num_layers": 4, "dim": 32, "num_heads": 2, "seq_len": 16, "moe": MOE}


def _cfg(**parallel: object) -> Config:
    return Config.model_validate(
        {"model": MODEL, "parallel": parallel, "train": {"global_batch": 8, "micro_batch": 2}, "recompute": "none"}
    )


def _hw(per_node: int) -> Hardware:
    return Hardware("h100", 80 * 2**30, 1e15, intra_gbs=100.0, inter_gbs=10.0, gpus_per_node=per_node)


def test_plan_enumerates_ep_and_says_it_assumes_balanced_routing(data_dir: Path, tmp_path: Path) -> None:
    args = tiny(data_dir, tmp_path / "run", **{f"model.moe.{k}": v for k, v in MOE.items()})
    done = meshrun_in_process(["plan", *args, "--gpus", "4", "--gpu", "h100", "--top", "200"], tmp_path=tmp_path)
    assert "planned with balanced routing" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line[:3].strip().isdigit()]
    assert {"ddp", "ddp+ep2", "ddp+ep4", "fsdp+ep4"} <= {row[3] for row in rows}, rows
    assert {("2", "ddp+ep2"), ("2", "fsdp+ep2")} <= {(row[1], row[3]) for row in rows}  # tp x ep (dp 2 x tp 2)
    assert {("2", "2", "ddp+ep4"), ("2", "1", "ddp+ep2")} <= {(row[1], row[2], row[3]) for row in rows}  # ep over tp


def test_experts_state_is_split_and_all_to_alls_priced() -> None:
    eff = Efficiency(p2p_s=1e-5)
    plain, ep2, ep4 = (predict(_cfg(dp=4, ep=ep), _hw(4), eff, precision="fp32", margin=0.1) for ep in (1, 2, 4))
    experts = 4 * (4 * (2 * 64 * 32 + 32 * 64)) * 4  # 4 layers of 4 experts, fp32
    assert plain.memory.params - ep2.memory.params == experts // 2
    assert plain.memory.params - ep4.memory.params == 3 * experts // 4
    assert plain.time.experts == 0.0
    # under fsdp the split experts are sharded over ep_dp too (parallel/fsdp.py): 1 / dp of them, as at ep 1
    sharded = [predict(_cfg(dp=4, ep=ep, dp_mode="fsdp"), _hw(4), eff, precision="fp32", margin=0.1) for ep in (1, 2)]
    assert sharded[1].memory.params == pytest.approx(sharded[0].memory.params, abs=4)
    assert sharded[1].time.experts > 0.0
    # per MoE layer and microbatch: 4 all-to-alls of top_k x tokens x hidden, (ep - 1) / ep of them sent,
    # and a count exchange; then the experts' gradients (their ep share) all-reduced over ep_dp
    rows = 2 * (2 * 16 * 32 * 4)
    m = 8 // 4 // 2
    per_layer = 4 * (0.5 * rows / 100e9 + 1e-5) + 1e-5
    sync = 2 * 0.5 * (experts / 2) / 100e9 + 1e-5
    assert ep2.time.experts == pytest.approx(m * 4 * per_layer + sync, rel=1e-9)
    across = predict(_cfg(dp=4, ep=4), _hw(2), eff, precision="fp32", margin=0.1)  # ep 4 spans two nodes
    assert across.time.experts > ep4.time.experts
    # compute at active parameters: the stages' FLOPs are the model's own count (k / E of the experts)
    model = build_model(_cfg().model)
    priced = sum(s.model_flops_per_token for s in layout_memory(_cfg(dp=4, ep=2), "fp32").stages)
    assert priced == pytest.approx(flops_at(model, 16), rel=1e-12)


@pytest.mark.parametrize("dp_mode", ["ddp", "fsdp"])
def test_dry_run_names_each_ep_ranks_experts_and_no_full_replicas(dp_mode: str) -> None:
    """--dry-run under ep: which experts each ep rank holds, and the data-parallel line speaks of the
    dense weights only (the experts are split over ep, not replicated or sharded over all dp ranks)."""
    from meshrun.planner.dry_run import describe_job

    cfg = _cfg(dp=4, ep=2, dp_mode=dp_mode)
    text = describe_job(cfg, build_model(cfg.model))
    assert "ep rank 0: experts 0-1; ep rank 1: experts 2-3" in text
    assert "full replicas" not in text and "each stage's dense weights" in text

    def state_mib(c: Config) -> float:
        found = re.search(r"pipeline rank 0: per rank params .* = ([\d.]+) MiB", describe_job(c, build_model(c.model)))
        assert found, "--dry-run prints each pipeline rank's state under ep too"
        return float(found.group(1))

    split, whole = state_mib(cfg), state_mib(_cfg(dp=4, ep=1, dp_mode=dp_mode))
    # ddp: each ep rank holds half the experts; fsdp: the experts are sharded over all 4 dp ranks either
    # way (rank_state_bytes against a real ep2 step: test_memory_model.py)
    assert split < whole if dp_mode == "ddp" else split == whole


def test_tp_keeps_each_moe_block_whole() -> None:
    """Under tp the MoE blocks are whole on every tp rank (parallel/tp_styles.py's moe_block): tp halves
    the dense weights alone, ep the experts alone, each the same with or without the other (the state
    against real tp2 x ep2 steps: tests/parallel/test_experts_train.py); --dry-run says so."""
    from meshrun.planner.dry_run import describe_job

    params = {
        (tp, ep): layout_memory(_cfg(dp=2, tp=tp, ep=ep), "fp32").ranks[0].params for tp in (1, 2) for ep in (1, 2)
    }
    experts = 4 * (4 * (2 * 64 * 32 + 32 * 64)) * 4  # 4 layers of 4 experts, fp32
    assert params[1, 1] - params[1, 2] == params[2, 1] - params[2, 2] == experts // 2
    assert params[1, 1] - params[2, 1] == params[1, 2] - params[2, 2] > 0
    cfg = _cfg(dp=2, tp=2, ep=2, sequence_parallel=True)
    text = describe_job(cfg, build_model(cfg.model))
    assert (
        "tp 2: each MoE block whole on every rank of a tp group (the whole sequence gathered first); each tp rank routes"
        in text
    )


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_prices_a_moe_block_without_the_mlps_collectives(sequence_parallel: bool) -> None:
    """A MoE block's MLP runs no tp collective (with sequence parallel: one all-gather each way, where a
    dense MLP runs two each way): its tp time is attention's alone, half a dense block's (3/4 under
    sequence parallel), a recomputed block's forward alike."""
    import dataclasses

    from meshrun.planner.cost import tensor_parallel_s
    from meshrun.planner.stage_cost import profile_stages

    for recompute in ("none", "full"):
        cfg = _cfg(dp=2, tp=2, ep=2, sequence_parallel=sequence_parallel).model_copy(update={"recompute": recompute})
        (stage,) = profile_stages(cfg, [[0, 1, 2, 3]], 2, "fp32")
        assert (stage.moe_blocks, stage.recomputed_moe_blocks) == (4, stage.recomputed_blocks)
        dense = dataclasses.replace(stage, moe_blocks=0, recomputed_moe_blocks=0)
        priced = [
            tensor_parallel_s([s], 2, gbs=100.0, eff=Efficiency(p2p_s=1e-5), sequence_parallel=sequence_parallel)
            for s in (stage, dense)
        ]
        assert priced[0] == pytest.approx(priced[1] * (0.75 if sequence_parallel else 0.5), rel=1e-12)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_prices_a_moe_block_on_its_own_positions_where_ep_spans_tp(sequence_parallel: bool) -> None:
    """Where ep spans tp a MoE block runs on the rank's own positions (parallel/token_share.py): its
    MLP runs one all-gather each way, half a dense MLP's all-reduces (under sequence parallel none):
    its tp time is 3/4 a dense block's (1/2 under sequence parallel), a recomputed block's forward
    alike; each tp rank computes 1/tp of the MoE FLOPs, where a block whole on every tp rank computes
    them all (the (tp - 1) / tp repeated, not counted as model FLOPs)."""
    import dataclasses

    from meshrun.planner.cost import tensor_parallel_s
    from meshrun.planner.stage_cost import profile_stages

    for recompute in ("none", "full"):
        spans, within = (
            _cfg(dp=2, tp=2, ep=ep, sequence_parallel=sequence_parallel).model_copy(update={"recompute": recompute})
            for ep in (4, 2)
        )
        (stage,) = profile_stages(spans, [[0, 1, 2, 3]], 2, "fp32")
        (whole,) = profile_stages(within, [[0, 1, 2, 3]], 2, "fp32")
        dense = dataclasses.replace(stage, moe_blocks=0, recomputed_moe_blocks=0)
        priced = [
            tensor_parallel_s(
                [s], 2, gbs=100.0, eff=Efficiency(p2p_s=1e-5), sequence_parallel=sequence_parallel, experts_over_tp=True
            )
            for s in (stage, dense)
        ]
        assert priced[0] == pytest.approx(priced[1] * (0.5 if sequence_parallel else 0.75), rel=1e-12)
        assert stage.replicated_flops_per_token == 0
        assert stage.model_flops_per_token == whole.model_flops_per_token
        experts = 4 * 4 * (2 * 64 * 32 + 32 * 64) * 2 / 4  # 4 layers of 4 experts: a token runs through 2
        router = 4 * 32 * 4  # 4 layers of a 32 x 4 router
        per_weight = 6 + 2 * (recompute == "full")  # trained: forward and backward, plus recompute's forward
        assert whole.replicated_flops_per_token == pytest.approx(per_weight * (experts + router) / 2, rel=1e-12)
        if recompute == "none":  # (full keeps each block's input alone, the same either way)
            assert whole.activation_bytes > stage.activation_bytes  # every position saved, not the rank's own half


def test_ep_spanning_tp_splits_the_experts_over_every_rank_of_the_group() -> None:
    """ep 4 at dp 2 x tp 2 (ep spanning tp: parallel/layout.py) holds a quarter of the experts per rank
    where ep 2 within dp holds half (the state against real dp2 x tp2 x ep4 steps:
    tests/parallel/test_experts_train.py); --dry-run names each ep rank's expert, the groups in ep rank
    order and how each tp rank routes; a degree neither rule takes is refused in one line."""
    from meshrun.planner.dry_run import describe_job

    params = {ep: layout_memory(_cfg(dp=2, tp=2, ep=ep), "fp32").ranks[0].params for ep in (2, 4)}
    experts = 4 * (4 * (2 * 64 * 32 + 32 * 64)) * 4  # 4 layers of 4 experts, fp32
    assert params[2] - params[4] == experts // 2 - experts // 4
    cfg = _cfg(dp=2, tp=2, ep=4, sequence_parallel=True)
    text = describe_job(cfg, build_model(cfg.model))
    assert "dp 2 (ddp, experts over ep 4 spanning tp) x tp 2" in text
    assert "ep group ([0, 1, 2, 3] on pipeline rank 0, in ep rank order" in text
    assert "ep rank 0: expert 0; ep rank 1: expert 1; ep rank 2: expert 2; ep rank 3: expert 3" in text
    assert (
        "tp 2: ep spans the tp ranks (ep 4 = tp 2 x 2 dp ranks); each tp rank holds its ep rank's experts and routes the positions it holds"
        in text
    )
    with pytest.raises(
        ValueError,
        match=re.escape("parallel.ep (3) must divide parallel.dp (2), or be parallel.tp (2) times a divisor of it"),
    ):
        _cfg(dp=2, tp=2, ep=3)
