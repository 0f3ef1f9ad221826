"""The layout object: every rank <-> place map the rest of meshrun asks for, checked against an
independent enumeration (nested loops in the documented rank order), and the meshes it builds."""

from __future__ import annotations

import inspect
import itertools
import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config.schema import Config
from meshrun.config.topology import ParallelConfig
from meshrun.errors import ConfigError
from meshrun.launcher.hang import HANG_DIR, Place, hang_summary
from meshrun.metrics.record import slowest_rank
from meshrun.metrics.time_split import PARTS, Stragglers
from meshrun.parallel.layout import AXES, EXPERT_VIEWS, VIEWS, Coordinates, Layout, place_text
from meshrun.parallel.mesh import Mesh, check_groups, flatten, init_mesh, shutdown


def enumerated(layout: Layout) -> dict[int, dict[str, int]]:
    """rank -> coordinates, by counting through the axes outermost first (the documented order)."""
    ranks = itertools.count()
    found = {}
    for coords in itertools.product(*(range(d) for d in layout.degrees.values())):
        place = dict(zip(layout.degrees, coords))
        dp = place["dp_replicate"] * layout.dp_shard + place["dp_shard"]
        cp = {"dp_cp": dp * layout.cp + place["cp"], "dp_shard_cp": place["dp_shard"] * layout.cp + place["cp"]}
        found[next(ranks)] = {**place, "dp": dp, **cp, "ep_dp": dp // layout.ep, "ep": dp % layout.ep}
    return found


@pytest.mark.parametrize(("pp", "replicate", "shard"), [(1, 1, 1), (2, 3, 1), (3, 1, 2), (2, 2, 2), (4, 1, 1)])
def test_ranks_and_coordinates_are_the_documented_order(pp: int, replicate: int, shard: int) -> None:
    layout = Layout(pp=pp, dp_replicate=replicate, dp_shard=shard)
    expected = enumerated(layout)
    assert layout.world_size == len(expected) == pp * replicate * shard
    assert layout.dp == replicate * shard
    for rank, coords in expected.items():
        assert layout.coordinates(rank) == coords
        assert layout.rank_at(**{axis: c for axis, c in coords.items() if axis in AXES}) == rank
        later = {
            axis: c for axis, c in coords.items() if axis in AXES and axis not in ("pp", "dp_replicate", "dp_shard")
        }
        assert layout.rank_at(pp=coords["pp"], dp=coords["dp"], **later) == rank
    for p in range(pp):
        assert layout.ranks_of_pp_rank(p) == [r for r, c in expected.items() if c["pp"] == p]
    groups = layout.across_pp(sorted({0, pp - 1}))
    assert sorted(r for g in groups for r in g) == sorted(r for r, c in expected.items() if c["pp"] in (0, pp - 1))
    for group in groups:  # one place on every other axis per group
        assert len({tuple(v for a, v in expected[r].items() if a != "pp") for r in group}) == 1


@pytest.mark.parametrize(
    ("mode", "dp", "shard", "degrees"),
    [("ddp", 4, None, (1, 4, 1)), ("fsdp", 4, None, (1, 1, 4)), ("hsdp", 4, 2, (1, 2, 2))],
)
def test_a_parallel_section_names_its_axes(mode: str, dp: int, shard: int | None, degrees: tuple[int, ...]) -> None:
    cfg = Config.model_validate({"parallel": {"dp": dp, "dp_mode": mode, "dp_shard": shard}})
    assert tuple(cfg.layout.degrees[axis] for axis in ("pp", "dp_replicate", "dp_shard")) == degrees
    assert all(d == 1 for axis, d in cfg.layout.degrees.items() if axis not in ("pp", "dp_replicate", "dp_shard"))
    assert cfg.world_size == dp
    assert cfg.layout.world_text() == f"parallel.dp x parallel.pp ({dp} x 1 = {dp})"


@pytest.mark.parametrize(
    ("schedule", "per_rank"), [("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2)]
)
def test_every_stage_is_held_by_one_pipeline_rank(schedule: str, per_rank: int) -> None:
    for pp in (2, 3, 4):
        layout = Layout(pp=pp, schedule=schedule, per_rank=per_rank)
        held = {stage: p for p in range(pp) for stage in layout.stages_of(p)}
        assert sorted(held) == list(range(layout.num_stages))
        assert all(layout.pp_rank_of_stage(stage) == p for stage, p in held.items())
    assert Layout(pp=2, schedule="zbv", per_rank=2).stages_of(0) == [0, 3]  # a V: rank r holds r and 2 pp - 1 - r


def test_the_mesh_of_a_lone_process_has_every_named_axis() -> None:
    mesh = init_mesh(Layout())
    try:
        assert mesh.world.mesh_dim_names == AXES
        assert all(mesh.view(name).mesh_dim_names == (name,) for name in (*AXES, *VIEWS))
        assert mesh.view("dp_shard", "tp").mesh_dim_names == ("dp_shard", "tp")
        assert (mesh.coordinates.cp, mesh.size("cp"), dist.get_world_size(mesh.group("cp"))) == (0, 1, 1)
        assert (mesh.rank, mesh.coordinates.pp, mesh.coordinates.dp, mesh.local_stages) == (0, 0, 0, [0])
        assert dist.get_world_size(mesh.group("dp")) == dist.get_world_size(mesh.group("pp")) == 1
        assert mesh.data_mesh is None
    finally:
        shutdown()


def test_torchs_private_flatten_still_makes_a_view() -> None:
    """`DeviceMesh._flatten` is private torch API, used once (parallel.mesh.flatten): a torch upgrade
    that renames or changes it fails here, by name, before any multi-rank run does."""
    assert "mesh_dim_name" in inspect.signature(DeviceMesh._flatten).parameters, "torch changed DeviceMesh._flatten"
    mesh = init_mesh(Layout())
    try:
        view = flatten(mesh.world, ("pp", "tp"), "pp_tp")
        assert view.mesh_dim_names == ("pp_tp",) and dist.get_process_group_ranks(view.get_group()) == [0]
    finally:
        shutdown()


def test_a_mesh_whose_groups_disagree_with_its_layout_is_refused() -> None:
    """The check every rank makes of torch's groups (parallel.mesh.check_groups; in a dp2 x tp2 x pp2
    world by test_tensor_parallel.py's 8-rank rows) fails when the layout places ranks elsewhere:
    here a layout of two dp ranks over a one-rank world."""
    mesh = init_mesh(Layout())
    try:
        wrong = Mesh(layout=Layout(dp_replicate=2), device=mesh.device, world=mesh.world, views=mesh.views)
        with pytest.raises(RuntimeError, match=re.escape("torch built the dp_replicate group of ranks [0]")):
            check_groups(wrong)
    finally:
        shutdown()


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"pp": 0}, "the pp degree of a layout must be a whole number >= 1, got 0"),
        ({"dp_shard": 2.0}, "the dp_shard degree"),
        ({"pp": 2, "schedule": "1f1b", "per_rank": 2}, "parallel.virtual_stages must be 1 for schedule 1f1b"),
        ({"pp": 2, "schedule": "zbv", "per_rank": 3}, "parallel.virtual_stages must be 2 for schedule zbv"),
    ],
)
def test_a_layout_validates_its_degrees(layout: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Layout(**layout)


@pytest.mark.parametrize(("pp", "replicate", "shard", "tp"), [(1, 1, 1, 2), (2, 2, 1, 2), (2, 1, 2, 4), (1, 2, 2, 2)])
def test_tp_is_the_innermost_axis(pp: int, replicate: int, shard: int, tp: int) -> None:
    """A tp group is neighbouring ranks: rank = (pp_rank * dp + dp_rank) * tp + tp_rank."""
    layout = Layout(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp)
    assert layout.world_size == pp * replicate * shard * tp
    for rank, coords in enumerated(layout).items():
        assert layout.coordinates(rank) == coords
        assert rank == (coords["pp"] * layout.dp + coords["dp"]) * tp + coords["tp"]
    assert layout.mesh_degrees == {"pp": pp, "dp": replicate * shard, "cp": 1, "tp": tp}


def test_messages_name_tp_only_when_it_splits() -> None:
    assert Layout(pp=2, dp_replicate=2).world_text() == "parallel.dp x parallel.pp (2 x 2 = 4)"
    split = Layout(pp=2, dp_replicate=2, tp=2)
    assert split.world_text() == "parallel.dp x parallel.pp x parallel.tp (2 x 2 x 2 = 8)"
    assert (
        split.grid() == "world size 8 = dp 2 (ddp) x tp 2 x pp 2 (1f1b); rank = (pp_rank * dp + dp_rank) * tp + tp_rank"
    )


@pytest.mark.parametrize(
    ("parallel", "text"),
    [
        ({}, "dp 1 x tp 1 x pp 1"),
        ({"dp": 2, "tp": 2}, "dp 2 (ddp) x tp 2 x pp 1"),  # the dp2 x tp2 run whose records said `dp2 x pp1`
        (
            {"dp": 2, "dp_mode": "fsdp", "tp": 2, "sequence_parallel": True},
            "dp 2 (fsdp) x tp 2 (sequence parallel) x pp 1",
        ),
        ({"dp": 4, "dp_mode": "hsdp", "dp_shard": 2, "pp": 2}, "dp 4 (hsdp, shard 2) x tp 1 x pp 2 (1f1b)"),
        ({"pp": 2, "schedule": "interleaved-1f1b"}, "dp 1 x tp 1 x pp 2 (interleaved-1f1b, 2 stages per rank)"),
        ({"pp": 2, "schedule": "zbv"}, "dp 1 x tp 1 x pp 2 (zbv, 2 stages per rank)"),
    ],
)
def test_the_layout_text_names_every_axis(parallel: dict, text: str) -> None:
    """One text for a layout wherever a record names it: every axis, dp's mode and tp's sequence
    parallelism, pp's schedule; a rank's label names its place on each axis."""
    layout = Layout.of(ParallelConfig(**parallel))
    assert layout.text() == text
    last = layout.world_size - 1
    assert layout.rank_text(last) == f"rank {last} (dp {layout.dp - 1}, tp {layout.tp - 1}, pp {layout.pp - 1})"


@pytest.mark.parametrize(
    ("pp", "replicate", "shard", "tp", "schedule"),
    [(2, 2, 1, 2, "1f1b"), (2, 1, 2, 2, "zbv"), (1, 2, 2, 2, "1f1b"), (3, 1, 1, 1, "interleaved-1f1b")],
)
def test_what_each_rank_reads_draws_and_counts(pp: int, replicate: int, shard: int, tp: int, schedule: str) -> None:
    """The questions the trainer asks of the layout, against the arithmetic it used to do itself
    (tp innermost): the samples a rank reads, its dropout stream, the ranks a loss is counted over,
    and each axis's group."""
    per_rank = 2 if schedule in ("zbv", "interleaved-1f1b") else 1
    layout = Layout(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp, schedule=schedule, per_rank=per_rank)
    batch, expected = 4 * layout.dp, enumerated(layout)
    for rank, coords in expected.items():
        assert layout.data_shard(rank, batch) == range(coords["dp"] * 4, coords["dp"] * 4 + 4)
        assert layout.seed_offset(rank) == rank // tp
        for name in (*AXES, *VIEWS):  # the ranks at this rank's place on every other axis, in order
            spans = VIEWS.get(name, (name,))
            same = [r for r, c in expected.items() if all(c[a] == coords[a] for a in AXES if a not in spans)]
            assert layout.group_ranks(rank, name) == sorted(same, key=lambda r: expected[r][name])
    holder = layout.pp_rank_of_stage(layout.num_stages - 1)  # zbv: the last stage is on pp rank 0
    assert layout.loss_ranks() == [r for r, c in expected.items() if c["pp"] == holder]
    assert len(layout.loss_ranks()) == layout.dp * tp


def test_coordinates_name_every_axis_and_view() -> None:
    coords = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2).coordinates(13)
    assert tuple(coords) == (*AXES, *VIEWS, *EXPERT_VIEWS) and isinstance(coords, Coordinates)
    assert (coords.pp, coords.dp, coords.tp, coords["dp_shard"]) == (1, 2, 1, 0)
    with pytest.raises(KeyError):
        coords["sp"]


def test_cp_sits_between_the_data_axes_and_tp() -> None:
    """torchtitan's order: rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank; cp ranks
    reduce gradients with the dp ranks (dp_cp) and FSDP shards over dp_shard x cp (dp_shard_cp)."""
    layout = Layout(pp=2, dp_replicate=2, cp=2, tp=2)
    for rank, coords in enumerated(layout).items():
        assert layout.coordinates(rank) == coords
        assert rank == ((coords["pp"] * layout.dp + coords["dp"]) * 2 + coords["cp"]) * 2 + coords["tp"]
    assert layout.group_ranks(5, "cp") == [5, 7] and layout.size("cp") == 2
    assert layout.world_text() == "parallel.dp x parallel.pp x parallel.cp x parallel.tp (2 x 2 x 2 x 2 = 16)"
    assert layout.grid().endswith("rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank")
    assert layout.group_ranks(5, "dp_cp") == [1, 3, 5, 7] and layout.fsdp_axes == ("dp_replicate", "dp_shard_cp")
    assert "cp 2" in layout.text()
    for mode, degrees, axes in (("ddp", {"dp_replicate": 2}, ()), ("fsdp", {"dp_shard": 2}, ("dp_shard_cp",))):
        assert Layout(cp=2, **degrees).fsdp_axes == axes, mode  # ddp: DDP over dp_cp
    assert Layout(cp=2, tp=2).fsdp_axes == ("dp_shard_cp",)  # ddp with tp: FSDP2 over cp


def test_two_cp_ranks_are_named_apart_in_straggler_and_hang_labels(tmp_path: Path) -> None:
    """Ranks 0 and 1 of a cp2 group differ only in cp: the straggler row, its warning, the run
    summary's slowest rank and the hang summary name it (a cp-1 layout's labels are unchanged)."""
    layout = Layout(dp_replicate=2, cp=2, tp=2)
    assert layout.place(2) == {"dp": 0, "cp": 1, "tp": 0, "pp": 0} and layout.place(0) != layout.place(2)
    assert layout.rank_text(2) == "rank 2 (dp 0, cp 1, tp 0, pp 0)"
    assert Layout(dp_replicate=2, tp=2).rank_text(2) == "rank 2 (dp 1, tp 0, pp 0)"
    row, _ = Stragglers(ratio=1.5, windows=1).row([[1.0] * len(PARTS)] * 2 + [[9.0] * len(PARTS)] * 6, layout=layout)
    assert row["straggler/cp"] == 1 and row["straggler/rank"] == 2
    slow = slowest_rank([{**row, "step": 1}])
    assert slow is not None and "cp 1" in place_text(slow)
    folder = tmp_path / HANG_DIR / "attempt-0"
    folder.mkdir(parents=True)
    for rank in (0, 2):  # rank 2 stalled in its forward, rank 0 waits in the all-to-all's backward
        phase = "forward" if rank == 2 else "backward"
        report = {**Place.of(layout, rank).report(), "phase": phase, "detail": "", "step": 3, "first_step": 1}
        (folder / f"rank{rank}.json").write_text(json.dumps({**report, "stalled_s": 9.0, "last_progress": 0.0}))
    found = hang_summary(tmp_path, 4, record=None)
    assert found is not None and "rank 2 (dp 0, cp 1, tp 0, pp 0, stages [0])" in found[0][0], found
