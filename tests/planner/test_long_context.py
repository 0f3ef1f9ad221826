"""`meshrun plan` with context parallel and activation offload (planner/long_context.py), in this
process: cp layouts proposed where only they fit, never where training would refuse them
(config/context.py's checks), and the all-to-alls and host copies priced as documented. The memory
of a real cp2 step and of a real offloaded step against the plan: test_memory_model.py."""

from __future__ import annotations

import pytest
from measure_memory import layout_config

from meshrun.planner.cost import Efficiency, Hardware, ring_s
from meshrun.planner.long_context import HOST_GBS
from meshrun.planner.search import candidates, meshes, predict, rank_layouts

CPU = Hardware("cpu", float("inf"), None, intra_gbs=10.0, inter_gbs=1.25, gpus_per_node=8)
GPU = Hardware("gpu", 80e9, 1e15, intra_gbs=450.0, inter_gbs=50.0, gpus_per_node=8)
EFF = Efficiency(achieved_flops=1e10, runtime_bytes=0)
LLAMA = (
    "model.hf_config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, max_position_embeddings: 1024, pad_token_id: 0}"
)


def test_cp_is_proposed_where_only_it_fits() -> None:
    """One sample of 8192 positions of an 8-block Llama on 2 devices: dp cannot split it; under
    full recompute tp2 keeps each block's whole input and pp2's last rank the whole logits, cp2
    half of each. Under a cap between them only cp2 layouts fit, priced with their all-to-alls."""
    long = LLAMA.replace("num_hidden_layers: 2", "num_hidden_layers: 8").replace("vocab_size: 256", "vocab_size: 64")
    long = long.replace("max_position_embeddings: 1024", "max_position_embeddings: 8192")
    cfg = layout_config([long, "model.seq_len=8192", "train.global_batch=1", "train.micro_batch=1"])
    least = {m.layout.text(): predict(m, CPU, EFF, precision="fp32", margin=0.0) for m in meshes(cfg, 2, 2)}
    cp2 = least.pop("dp 1 x cp 2 x tp 1 x pp 1")
    assert {"dp 1 x tp 2 x pp 1", "dp 1 x tp 1 x pp 2"} <= {name.split(" (")[0] for name in least}  # no dp 2: batch 1
    others = min(p.memory.total for p in least.values())
    assert cp2.memory.total < others
    cap = (cp2.memory.total + others) / 2
    ranked = rank_layouts(cfg, 2, Hardware("cpu", cap, None, 10.0, 1.25, 2), EFF, precision="fp32", margin=0.0)
    fitting = [p for p in ranked if p.fits]
    assert fitting and all(p.cfg.parallel.cp == 2 for p in fitting)
    assert fitting[0].label["cp"] == 2 and fitting[0].time.context > 0


@pytest.mark.parametrize(
    ("overrides", "devices", "cps"),
    [
        ([], 4, {1, 2, 4}),  # 4 heads, seq_len 16
        (["model.dim=48", "model.num_heads=3"], 2, {1}),  # heads cp does not divide
        (["model.seq_len=15"], 2, {1}),  # positions cp does not divide
        (["task=classification", "model.name=encoder", "model.num_labels=3"], 2, {1}),  # not a decoder
        ([LLAMA], 4, {1, 2}),  # 2 kv heads: cp 4 would repeat them
        ([LLAMA.replace("llama", "phi3")], 2, {1}),  # a decoder cp does not split
    ],
    ids=["gpt", "heads", "seq-len", "encoder", "llama-kv-heads", "phi3"],
)
def test_cp_is_proposed_only_where_training_runs_it(overrides: list[str], devices: int, cps: set[int]) -> None:
    cfg = layout_config([*overrides, "train.global_batch=4"])
    assert {c.parallel.cp for c in candidates(cfg, devices)} == cps


def test_the_all_to_alls_are_priced_per_attention() -> None:
    """cp2 on the tiny GPT (4 blocks, dim 32, fp32, micro_batch 2 of 16 positions): per block four
    all-to-alls in the forward (q, k, v, the output) plus the positions' gather, four in the
    backward, each moving half of T/cp x dim; a recomputed block's forward adds its five again."""
    for recompute, forwards in (("none", 4), ("full", 8)):
        cfg = layout_config(["parallel.cp=2", "train.global_batch=2", "train.micro_batch=2", f"recompute={recompute}"])
        time = predict(cfg, CPU, EFF, precision="fp32", margin=0.0).time
        exchange = 4 * ring_s(2 * 8 * 32 * 4, 2, CPU.intra_gbs, 1.0) + 4 * EFF.p2p_s
        assert time.context == pytest.approx(forwards * (exchange + EFF.p2p_s) + 4 * exchange, rel=1e-9)
    assert (
        predict(
            layout_config(["train.global_batch=2", "train.micro_batch=2"]), CPU, EFF, precision="fp32", margin=0.0
        ).time.context
        == 0
    )


def test_offload_is_planned_on_a_gpu_with_its_host_memory_and_copies() -> None:
    """On a GPU offload's rows appear (recompute none and every:2, the other blocks offloaded),
    holding less on the device and the rest on the host; its copies add only what the compute does
    not hide, at HOST_GBS. A CPU plan offers none (its host is its device)."""
    cfg = layout_config(["model.seq_len=256", "train.global_batch=4", "train.micro_batch=2"])
    assert not any(c.train.offload_activations for c in candidates(cfg, 1))
    plain = predict(cfg, GPU, EFF, precision="fp32", margin=0.0)
    offloaded = layout_config(
        ["model.seq_len=256", "train.global_batch=4", "train.micro_batch=2", "train.offload_activations=true"]
    )
    ours = predict(offloaded, GPU, EFF, precision="fp32", margin=0.0)
    assert ours.memory.activations < plain.memory.activations and ours.memory.host > 0 and plain.memory.host == 0
    assert ours.label["offload"] == "on" and plain.label["offload"] == "-"
    compute = plain.time.compute / cfg.accumulation_steps
    copy = ours.memory.host / (HOST_GBS * 1e9)
    exposed = max(0.0, copy - compute / 3) + max(0.0, copy - 2 * compute / 3)
    assert ours.time.host == pytest.approx(cfg.accumulation_steps * exposed, rel=1e-9)
    assert ours.time.total == pytest.approx(plain.time.total + ours.time.host, rel=1e-9)
    rows = rank_layouts(cfg, 1, GPU, EFF, precision="fp32", margin=0.0)
    assert {(p.cfg.recompute, p.label["offload"]) for p in rows} >= {("none", "on"), ("every:2", "on")}
