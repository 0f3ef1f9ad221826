"""The layout object: every rank <-> place map the rest of meshrun asks for, checked against an
independent enumeration (nested loops in the documented rank order), and the meshes it builds."""

from __future__ import annotations

import itertools
import re

import pytest
import torch.distributed as dist

from meshrun.config.schema import Config
from meshrun.config.topology import ParallelConfig
from meshrun.errors import ConfigError
from meshrun.parallel.layout import Layout
from meshrun.parallel.mesh import init_mesh, shutdown


def enumerated(layout: Layout) -> dict[int, dict[str, int]]:
    """rank -> coordinates, by counting through the axes outermost first (the documented order)."""
    ranks = itertools.count()
    found = {}
    for coords in itertools.product(*(range(d) for d in layout.degrees.values())):
        place = dict(zip(layout.degrees, coords))
        found[next(ranks)] = {**place, "dp": place["dp_replicate"] * layout.dp_shard + place["dp_shard"]}
    return found


@pytest.mark.parametrize(("pp", "replicate", "shard"), [(1, 1, 1), (2, 3, 1), (3, 1, 2), (2, 2, 2), (4, 1, 1)])
def test_ranks_and_coordinates_are_the_documented_order(pp: int, replicate: int, shard: int) -> None:
    layout = Layout(pp=pp, dp_replicate=replicate, dp_shard=shard)
    expected = enumerated(layout)
    assert layout.world_size == len(expected) == pp * replicate * shard
    assert layout.dp == replicate * shard
    for rank, coords in expected.items():
        assert layout.coordinates(rank) == coords
        assert layout.rank_at(**{axis: c for axis, c in coords.items() if axis != "dp"}) == rank
        later = {axis: c for axis, c in coords.items() if axis not in ("pp", "dp", "dp_replicate", "dp_shard")}
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
        assert mesh.device_mesh.mesh_dim_names == tuple(mesh.layout.mesh_degrees)
        assert mesh.device_mesh.mesh_dim_names[:2] == ("pp", "dp")
        assert (mesh.rank, mesh.pp_rank, mesh.dp_rank, mesh.local_stages) == (0, 0, 0, [0])
        assert dist.get_world_size(mesh.dp_group) == dist.get_world_size(mesh.pp_group) == 1
        assert mesh.data_mesh is None
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
    assert layout.mesh_degrees == {"pp": pp, "dp": replicate * shard, "tp": tp}


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
