"""Expert parallelism (parallel/experts.py): transformers' own Qwen3-MoE sparse block split over ep
ranks equals the whole block on the global batch in one process (outputs, router and expert
gradients, the gradient norm), a misrouted variant does not, and checkpoints reshard across ep."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import meshrun_env
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.parallel.experts import check_experts_split
from meshrun.parallel.layout import Layout

WORKER = Path(__file__).with_name("experts_worker.py")
TOLERANCE = 1e-5  # relative to the largest value compared


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One 4-rank launch; every rank's measurements (experts_worker.py)."""
    out = tmp_path_factory.mktemp("experts")
    argv = [
        sys.executable,
        "-P",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        str(WORKER),
        str(out),
    ]
    env = meshrun_env(out, PYTHONPATH=str(WORKER.parents[2]))
    done = subprocess.run(argv, cwd=out, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", ["ep2", "ep4", "fsdp_ep2"])
def test_split_experts_equal_one_process(measured: list[dict], ep: str) -> None:
    """Outputs and gradients (router: dense, DDP's mean; experts: summed over ep_dp, over dp; under
    fsdp reduce-scattered over ep_dp) equal the whole block's on the whole batch, and so does the
    global gradient norm; every token chose the experts it chose in the whole block."""
    for found in measured:
        diffs = found[ep]
        assert diffs["misrouted"] == 0, diffs  # token by token: the same experts as the whole block chose
        assert diffs["output"] < TOLERANCE and diffs["router_grad"] < TOLERANCE * found["reference_norm"], diffs
        assert max(diffs["gate_up_proj_grad"], diffs["down_proj_grad"]) < TOLERANCE * found["reference_norm"], diffs
        assert diffs["norm"] == pytest.approx(found["reference_norm"], rel=TOLERANCE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["plain", "sequence"])
def test_experts_split_over_tp_equal_one_process(measured: list[dict], variant: str) -> None:
    """dp 2 x tp 2 with ep 4 spanning tp (Layout.experts_over_tp), without and with sequence parallel:
    each tp rank routes its own positions, so its output rows, the input's gradient, the router's (summed
    over tp) and its experts' gradients and the global norm equal the whole block's on the whole batch."""
    for found in measured:
        diffs = found[f"over_tp_{variant}"]
        scale = TOLERANCE * diffs["reference_norm"]
        assert diffs["misrouted"] == 0, diffs  # each tp rank's tokens reach the experts the whole block chose
        assert diffs["output"] < TOLERANCE and diffs["input_grad"] < scale and diffs["router_grad"] < scale, diffs
        assert max(diffs["gate_up_proj_grad"], diffs["down_proj_grad"]) < scale, diffs
        assert diffs["norm"] == pytest.approx(diffs["reference_norm"], rel=TOLERANCE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["router_not_summed", "tokens_not_split"])
def test_experts_split_over_tp_broken_are_seen(measured: list[dict], variant: str) -> None:
    """The router's gradient left unsummed over tp (each tp rank's from its own positions), or every tp
    rank routing all positions (the experts' and router's gradients counted tp times): the router's
    gradient differs on every rank, far beyond the tolerance."""
    for found in measured:
        diffs = found[f"over_tp_{variant}"]
        assert diffs["router_grad"] > 1e3 * TOLERANCE * diffs["reference_norm"], diffs


@pytest.mark.timeout(300)
def test_fsdp_shards_split_experts_over_ep_dp(measured: list[dict]) -> None:
    """Under fsdp each rank holds half of its ep rank's 4 experts' weights: dim 1 split over ep_dp 2."""
    for found in measured:
        assert found["fsdp_ep2"]["layouts"] == {
            "gate_up_proj": [["ep_dp"], ["S(1)"], [4, 8, 16]],
            "down_proj": [["ep_dp"], ["S(1)"], [4, 8, 8]],
        }


@pytest.mark.timeout(300)
def test_fp16_scaler_unscales_experts_sharded_over_ep_dp(measured: list[dict]) -> None:
    """The loss scaler unscales the experts sharded over ep_dp beside the other weights in one step
    (torch's foreach kernels refuse a mix of meshes), and an inf in one rank's shard backs off every rank."""
    assert all(found["fsdp_ep2"]["fp16_scales"] == [1024.0, 512.0] for found in measured)


@pytest.mark.timeout(300)
def test_expert_groups_are_the_layouts(measured: list[dict]) -> None:
    """ep: neighbouring dp ranks; ep_dp: the ranks holding the same experts."""
    assert [m["ep2_groups"] for m in measured] == [
        {"ep": [0, 1], "ep_dp": [0, 2]},
        {"ep": [0, 1], "ep_dp": [1, 3]},
        {"ep": [2, 3], "ep_dp": [0, 2]},
        {"ep": [2, 3], "ep_dp": [1, 3]},
    ]
    assert all(m["ep4_groups"] == {"ep": [0, 1, 2, 3], "ep_dp": [r]} for r, m in enumerate(measured))


@pytest.mark.timeout(300)
def test_outputs_returned_to_the_wrong_rows_are_seen(measured: list[dict]) -> None:
    assert all(m["broken"] > 1e3 * TOLERANCE for m in measured)


@pytest.mark.timeout(300)
def test_a_checkpoint_at_ep2_resumes_at_ep1_and_ep4(measured: list[dict]) -> None:
    assert all(m["resumed"] == {"ep1": 0.0, "ep4": 0.0} for m in measured)


def test_torchs_private_unflatten_still_splits_a_view() -> None:
    """`DeviceMesh._unflatten` (parallel.mesh, the dp view split for ep) is private torch API."""
    assert list(inspect.signature(DeviceMesh._unflatten).parameters)[1:4] == ["dim", "mesh_sizes", "mesh_dim_names"]


def test_ep_borrows_the_innermost_dp_ranks() -> None:
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, ep=2)
    assert layout.text() == "dp 4 (hsdp, shard 2, experts over ep 2) x tp 1 x pp 2 (1f1b)"
    assert (layout.size("ep"), layout.size("ep_dp"), layout.world_size) == (2, 2, 8)
    assert [(layout.coordinates(r).ep_dp, layout.coordinates(r).ep) for r in range(4, 8)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert layout.group_ranks(5, "ep") == [4, 5] and layout.group_ranks(5, "ep_dp") == [5, 7]


def test_ep_larger_than_dp_takes_whole_tp_groups() -> None:
    """One rule: ep divides dp (dp ranks only, as before), or is tp times a divisor of dp (whole tp
    groups too: the dp x tp ranks split as ep_dp * ep + ep)."""
    within = Layout(dp_replicate=2, tp=2, ep=2)
    assert not within.experts_over_tp and within.group_ranks(0, "ep") == [0, 2] and within.routing_copies == 2
    over = Layout(dp_replicate=2, tp=2, ep=4)
    assert over.text() == "dp 2 (ddp, experts over ep 4 spanning tp) x tp 2 x pp 1"
    assert [over.coordinates(r).ep for r in range(4)] == [0, 1, 2, 3] and over.routing_copies == 1
    assert over.group_ranks(3, "ep") == [0, 1, 2, 3] and over.group_ranks(3, "ep_dp") == [3]
    odd = Layout(pp=2, dp_replicate=3, tp=2, ep=2)  # 3 dp ranks: each tp group an ep group, ep_dp 3
    assert (odd.size("ep"), odd.size("ep_dp")) == (2, 3)
    assert odd.group_ranks(9, "ep") == [8, 9] and odd.group_ranks(9, "ep_dp") == [7, 9, 11]


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"dp": 4, "ep": 3}, "parallel.ep (3) must divide parallel.dp (4)"),
        ({"dp": 2, "tp": 2, "ep": 8}, "parallel.ep (8) must divide parallel.dp (2), or be parallel.tp (2) times"),
        ({"dp": 2, "ep": 2, "cp": 2}, "parallel.ep and parallel.cp cannot both split yet: set one of them to 1"),
    ],
)
def test_ep_settings_are_checked(parallel: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Config.model_validate({"parallel": parallel})


def test_ep_needs_experts_it_can_divide() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=6))
    check_experts_split(block, 3)
    with pytest.raises(
        ConfigError, match=re.escape("parallel.ep (4) must divide the number of experts (6 in experts)")
    ):
        check_experts_split(block, 4)
    with pytest.raises(ConfigError, match=re.escape("parallel.ep is 2 but the model has no MoE layers")):
        check_experts_split(nn.Linear(2, 2), 2)
