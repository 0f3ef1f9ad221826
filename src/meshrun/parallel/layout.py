"""The one layout object: the mesh axes by name, their degrees, and every map between a rank and its
place, including which pipeline stages a rank holds. Everything else asks it instead of computing:
a rank's coordinates, which samples it reads, which dropout stream it draws, over which ranks a
loss is counted, which axes FSDP shards over.

Axes, outermost first (`AXES`): `pp`, then data parallelism as `dp_replicate` x `dp_shard` (ddp:
dp x 1, fsdp: 1 x dp, hsdp: dp / dp_shard x dp_shard), then context parallelism `cp` (each sample's
positions split: parallel/context.py), then tensor parallelism `tp`. A rank is the mixed-radix number of
its coordinates, so `rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank` with
`dp_rank = replica * dp_shard + shard`: a tp group is neighbouring ranks (it talks at every block,
so it gets one node's fastest links), a cp group next (keys and values pass round it at every
attention layer, as torchtitan places it), a copy's shards after (the heavy gradient traffic) and
consecutive pipeline stages are `dp x cp x tp` ranks apart (activations are small point-to-point messages).

A view (`VIEWS`) is a group of axes flattened into one: `dp` is `dp_replicate` x `dp_shard`, a rank's
coordinate on it the mixed-radix number of its coordinates on those axes. An axis that borrows ranks
from others is a view too, not a new factor of the world size. Expert parallelism (`parallel.ep`) splits
the `dp` view in two (`EXPERT_VIEWS`): a dp coordinate is `ep_dp * ep + ep`, so `ep` is the innermost
`ep` data-parallel ranks (they split each MoE layer's experts: within `dp_shard` when it is at least
`ep`, as torchtitan borrows them) and `ep_dp` the ranks that hold the same experts (their gradients are
averaged over it). Under tp, an ep that divides dp borrows no tp rank: each MoE block is whole on every
tp rank of a group, each tp coordinate with its own ep groups. An ep that does not divide dp takes whole
tp groups as well (`experts_over_tp`: ep = tp x a divisor of dp): it splits the stage's ranks flattened
as `dp x tp` (a coordinate `dp * tp + tp`, the rank order) into `ep_dp * ep + ep`, so an ep group is
ep / tp neighbouring dp ranks with all their tp ranks, and each tp rank routes its own share of the
tokens (parallel/experts.py). The world size stays
the product of `AXES`; `parallel.mesh` builds every view as a group of the one world mesh.

Torch-free (the config's own rules ask it for the world size); `parallel.mesh` builds the device mesh.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Protocol

from meshrun.errors import ConfigError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
PLACE_AXES = ("dp", "cp", "tp", "pp")  # the order a rank's place is named in (cp only where it splits)
DATA_AXES = ("dp_replicate", "dp_shard")  # flattened, they are the data-parallel axis `dp`
# name -> the axes it flattens (outermost first), see the module docstring. cp ranks hold the same weights
# and reduce their gradients as dp ranks do: DDP over `dp_cp`, FSDP shards over `dp_shard_cp` (torchtitan's).
VIEWS = {"dp": DATA_AXES, "dp_cp": (*DATA_AXES, "cp"), "dp_shard_cp": ("dp_shard", "cp")}
EXPERT_VIEWS = ("ep_dp", "ep")  # the dp view split in two by parallel.ep, outermost first (module docstring)
# The config keys whose product is the world size; `parallel.cp` and `parallel.tp` are named only
# when they split (`keys`), so messages about dp x pp layouts read as they always have.
KEYS = {"dp": "parallel.dp", "pp": "parallel.pp", "cp": "parallel.cp", "tp": "parallel.tp"}
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle: one stage per rank
V_SCHEDULES = ("zbv",)  # exactly two stages per rank, placed in a V: rank r holds r and 2 pp - 1 - r


@dataclass(frozen=True, eq=False)
class Coordinates(Mapping[str, int]):
    """A rank's coordinate on every axis (`AXES`) and view (`VIEWS`): its rank within that axis's group.
    Read by name (`coords.tp`, or `coords["tp"]` where the axis is a variable); equal to a dict of the same."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    dp: int  # the view over both data axes: this rank's index among the data-parallel ranks
    dp_cp: int  # the view over the data axes and cp: the ranks that hold the same weights
    dp_shard_cp: int  # the view FSDP shards over when cp > 1
    ep_dp: int  # which copy of the experts this rank holds (dp // ep; (dp * tp + tp) // ep when ep spans tp)
    ep: int  # which share of each MoE layer's experts it holds (dp % ep; (dp * tp + tp) % ep when ep spans tp)

    def __getitem__(self, name: str) -> int:
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return (field.name for field in fields(self))

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


class ParallelSection(Protocol):
    """What the layout reads of the config's `parallel` section (meshrun.config.topology.ParallelConfig)."""

    @property
    def dp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def dp_mode(self) -> str: ...
    @property
    def dp_shard(self) -> int | None: ...
    @property
    def cp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def schedule(self) -> str: ...
    @property
    def virtual_stages(self) -> int | None: ...
    @property
    def ep(self) -> int: ...


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """Pipeline stages each rank holds under `schedule` (`parallel.virtual_stages` checked)."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        if requested not in (None, 1):
            raise ConfigError(
                f"parallel.virtual_stages must be 1 for schedule {schedule}; use interleaved-1f1b for more"
            )
        return 1
    if schedule in V_SCHEDULES and requested not in (None, 2):
        raise ConfigError(f"parallel.virtual_stages must be 2 for schedule {schedule} (two stages per rank, in a V)")
    return requested or 2


@dataclass(frozen=True)
class Layout:
    """Degrees of every axis, and the schedule's placement of pipeline stages on pp ranks."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    per_rank: int = 1  # pipeline stages each pp rank holds
    sequence_parallel: bool = False  # tp ranks also split norms' and dropout's activations by position
    ep: int = 1  # expert parallelism: the dp (and tp) ranks each MoE layer's experts are split over (EXPERT_VIEWS)

    def __post_init__(self) -> None:
        for name, degree in {**self.degrees, "per_rank": self.per_rank, "ep": self.ep}.items():
            if not isinstance(degree, int) or degree < 1:
                raise ConfigError(f"the {name} degree of a layout must be a whole number >= 1, got {degree!r}")
        if self.dp % self.ep and not self.experts_over_tp:
            raise ConfigError(expert_degree_error(self.ep, self.dp, self.tp))
        if self.ep > 1 and self.cp > 1:
            raise ConfigError("parallel.ep and parallel.cp cannot both split yet: set one of them to 1")
        if self.pp > 1:
            stages_per_rank(self.schedule, self.per_rank)  # the schedule can hold that many per rank

    @classmethod
    def of(cls, par: ParallelSection) -> Layout:
        """The layout a `parallel` section describes."""
        shard = {"ddp": 1, "fsdp": par.dp, "hsdp": par.dp_shard or 1}[par.dp_mode]
        per_rank = stages_per_rank(par.schedule, par.virtual_stages) if par.pp > 1 else 1
        return cls(
            pp=par.pp,
            dp_replicate=par.dp // shard,
            dp_shard=shard,
            cp=par.cp,
            tp=par.tp,
            schedule=par.schedule,
            per_rank=per_rank,
            sequence_parallel=par.sequence_parallel,
            ep=par.ep,
        )

    @property
    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas x shards."""
        return self.size("dp")

    @property
    def experts_over_tp(self) -> bool:
        """Whether parallel.ep takes whole tp groups beside dp ranks: an ep that does not divide dp but is
        tp times a divisor of dp (module docstring); each tp rank then routes its own share of the tokens."""
        return ep_spans_tp(self.ep, self.dp, self.tp)

    @property
    def routing_copies(self) -> int:
        """The ranks that route each token alike, whose routing figures count once: a tp group's, where
        each MoE block is whole on every tp rank; 1 where ep spans tp (each rank routes its own tokens)."""
        return 1 if self.experts_over_tp else self.tp

    def size(self, name: str) -> int:
        """The degree of an axis, or of a view (the product of its axes')."""
        if name in EXPERT_VIEWS:
            return self.ep if name == "ep" else self.dp * self._ep_tp // self.ep
        return math.prod(getattr(self, axis) for axis in VIEWS.get(name, (name,)))

    @property
    def _ep_tp(self) -> int:
        """The tp ranks an ep group takes (all of a tp group's where ep spans tp, else none: 1)."""
        return self.tp if self.experts_over_tp else 1

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def mesh_degrees(self) -> dict[str, int]:
        """Degrees of the mesh every rank builds: pp, the data axes flattened into `dp`, then any later axis."""
        later = {axis: getattr(self, axis) for axis in AXES if axis not in ("pp", *DATA_AXES)}
        return {"pp": self.pp, "dp": self.dp, **later}

    @property
    def keys(self) -> dict[str, str]:
        """The mesh axes messages name, with their config keys: dp and pp, and cp and tp when they split."""
        return {name: key for name, key in KEYS.items() if name in ("dp", "pp") or self.size(name) > 1}

    def axes_text(self) -> str:
        """The keys whose product is the world size, for messages."""
        return " x ".join(self.keys.values())

    def degrees_text(self) -> str:
        """`2 x 4`: the degrees in the order of `axes_text`."""
        return " x ".join(str(self.mesh_degrees[name]) for name in self.keys)

    def world_text(self) -> str:
        """The world size as the config spells it, for messages: `parallel.dp x parallel.pp (2 x 4 = 8)`."""
        return f"{self.axes_text()} ({self.degrees_text()} = {self.world_size})"

    @property
    def dp_mode(self) -> str:
        """ddp (replicas), fsdp (one copy sharded over every dp rank) or hsdp (both), read off the degrees."""
        if self.dp_shard == 1:
            return "ddp"
        return "fsdp" if self.dp_replicate == 1 else "hsdp"

    def text(self) -> str:
        """The whole layout, as every record names it (summaries, `meshrun report`, headers, plots):
        `dp 4 (hsdp, shard 2) x tp 2 (sequence parallel) x pp 2 (interleaved-1f1b, 2 stages per rank)`;
        an axis of degree 1 is named bare, so a layout never reads as if an axis were absent (cp is named
        only when it splits, so that every record of a layout without it reads as before)."""
        dp = {"ddp": "ddp", "fsdp": "fsdp", "hsdp": f"hsdp, shard {self.dp_shard}"}[self.dp_mode]
        dp += f", experts over ep {self.ep}" + (" spanning tp" if self.experts_over_tp else "") if self.ep > 1 else ""
        pp = self.schedule + (f", {self.per_rank} stages per rank" if self.per_rank > 1 else "")
        parts = (
            ("dp", self.dp, dp if self.dp > 1 or self.ep > 1 else None),
            ("tp", self.tp, "sequence parallel" if self.sequence_parallel else None),
            ("pp", self.pp, pp if self.pp > 1 else None),
        )
        if self.cp > 1:
            parts = (parts[0], ("cp", self.cp, None), *parts[1:])
        return " x ".join(f"{axis} {degree}" + (f" ({how})" if how else "") for axis, degree, how in parts)

    def place(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinates on the axes a layout is named by, in their order: {dp, tp, pp}, and
        cp between dp and tp where it splits (two cp ranks are otherwise alike; at cp 1 the labels
        read as they always have)."""
        coords = self.coordinates(rank)
        return {axis: coords[axis] for axis in PLACE_AXES if axis != "cp" or self.cp > 1}

    def rank_text(self, rank: int) -> str:
        """`rank 5 (dp 0, tp 1, pp 1)`: a rank as warnings and reports name it."""
        return f"rank {rank} ({place_text(self.place(rank))})"

    def grid(self) -> str:
        """The rank order, for --dry-run: `rank = (pp_rank * dp + dp_rank) * tp + tp_rank`, over the
        axes messages name (`keys`), outermost first."""
        first, *inner = (axis for axis in self.mesh_degrees if axis in self.keys)
        order = f"{first}_rank"
        for axis in inner:
            order = f"{f'({order})' if '+' in order else order} * {axis} + {axis}_rank"
        return f"world size {self.world_size} = {self.text()}; rank = {order}"

    # ranks <-> coordinates

    def coordinates(self, rank: int) -> Coordinates:
        """`rank`'s coordinate on every axis and view: the inverse of `rank_at`."""
        coords = self._digits(rank, AXES)
        views = {name: self._number(coords, axes) for name, axes in VIEWS.items()}
        ep_dp, ep = divmod(views["dp"] * self._ep_tp + (coords["tp"] if self.experts_over_tp else 0), self.ep)
        return Coordinates(**coords, **views, ep_dp=ep_dp, ep=ep)

    def rank_at(self, **coords: int) -> int:
        """The rank at these coordinates (axes, or a view for the axes it flattens; those not given at 0)."""
        for name, axes in VIEWS.items():
            if name in coords:
                coords.update(self._digits(coords.pop(name), axes))
        return self._number(coords, AXES)

    def _number(self, coords: Mapping[str, int], axes: tuple[str, ...]) -> int:
        """The mixed-radix number of `coords` on `axes` (outermost first; an axis not given at 0)."""
        number = 0
        for axis in axes:
            number = number * getattr(self, axis) + coords.get(axis, 0)
        return number

    def _digits(self, number: int, axes: tuple[str, ...]) -> dict[str, int]:
        """The coordinates on `axes` whose mixed-radix number is `number` (the inverse of `_number`)."""
        digits: dict[str, int] = {}
        for axis in reversed(axes):
            number, digits[axis] = divmod(number, getattr(self, axis))
        return {axis: digits[axis] for axis in axes}

    def group_ranks(self, rank: int, name: str) -> list[int]:
        """The ranks of `rank`'s group on axis or view `name` (those at its place on every other axis),
        in the order of their coordinate on `name`: the group torch builds for it (parallel.mesh)."""
        if name in EXPERT_VIEWS:  # the dp (x tp) ranks of this rank's place that differ only on `name`
            c, over = self.coordinates(rank), self._ep_tp
            flat = (
                (c.ep_dp * self.ep + e for e in range(self.ep))
                if name == "ep"
                else range(c.ep, self.dp * over, self.ep)
            )
            places = (divmod(f, over) if over > 1 else (f, c.tp) for f in flat)
            return [self.rank_at(pp=c.pp, dp=dp, tp=tp) for dp, tp in places]
        spans = VIEWS.get(name, (name,))
        here = {axis: c for axis, c in self.coordinates(rank).items() if axis in AXES and axis not in spans}
        ranges = (range(getattr(self, axis)) for axis in spans)
        return [self.rank_at(**here, **dict(zip(spans, c))) for c in itertools.product(*ranges)]

    # what each rank reads, draws and counts

    def data_shard(self, rank: int, batch: int) -> range:
        """The samples of a `batch`-sample global batch that `rank` reads: the dp ranks split it in dp
        order; ranks at one dp coordinate (a tp or cp group, the stages of a pipeline) read the same ones
        (a cp rank keeps its positions of them: parallel/context.py)."""
        per_rank = batch // self.dp
        first = self.coordinates(rank).dp * per_rank
        return range(first, first + per_rank)

    def seed_offset(self, rank: int) -> int:
        """Which dropout stream `rank` draws from (added to train.seed): one per tp group, numbered in
        rank order, as tp ranks hold the same activations outside the split matrices and must drop the
        same ones (where they hold different ones, parallel/tp_rng.py seeds a stream per tp rank)."""
        return self._number(self.coordinates(rank), tuple(axis for axis in AXES if axis != "tp"))

    def loss_ranks(self) -> list[int]:
        """The ranks whose loss a step's mean counts: the last stage's (the other stages hold none), one
        per dp, cp and tp coordinate; tp ranks hold the same value, each dp rank its own samples', each
        cp rank its own positions' (their mean is the step's loss: training/loss.py divides by dp x cp)."""
        return self.ranks_of_pp_rank(self.pp_rank_of_stage(self.num_stages - 1))

    def ranks_of_pp_rank(self, pp_rank: int) -> list[int]:
        """Every rank that runs pipeline rank `pp_rank`'s stages (its copies and shards on the other axes)."""
        return [rank for rank in range(self.world_size) if self.coordinates(rank).pp == pp_rank]

    def across_pp(self, pp_ranks: list[int]) -> list[list[int]]:
        """For each place on the other axes, the ranks there at `pp_ranks`: the groups in which copies
        of one parameter held by several pipeline ranks (a tied embedding) are kept equal."""
        others = [
            {a: c for a, c in self.coordinates(r).items() if a in AXES and a != "pp"} for r in self.ranks_of_pp_rank(0)
        ]
        return [[self.rank_at(pp=p, **place) for p in pp_ranks] for place in others]

    # pipeline stages

    @property
    def num_stages(self) -> int:
        return self.pp * self.per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stages held by a pipeline rank: loop style (r, r + pp, ...) for interleaved schedules, a V
        (r and 2 pp - 1 - r) for zbv, stage 0 without a pipeline."""
        if self.schedule in V_SCHEDULES and self.pp > 1:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + v * self.pp for v in range(self.per_rank)]

    def pp_rank_of_stage(self, stage: int) -> int:
        """The pipeline rank that holds `stage` (the inverse of `stages_of`)."""
        if self.schedule in V_SCHEDULES and self.pp > 1:
            return min(stage, 2 * self.pp - 1 - stage)
        return stage % self.pp

    # what FSDP shards over

    @property
    def shard_degree(self) -> int:
        """The ranks one copy of the training state is split over by FSDP (1: DDP's whole replicas)."""
        return self.size(self.fsdp_axes[-1]) if self.fsdp_axes else 1

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The axes FSDP2 shards over, none for DDP: `dp_shard` for fsdp; both data axes for hsdp and
        for ddp with tp > 1 (FSDP2 keeps its replicas, a shard degree of 1: fsdp.py). With cp > 1 the
        shard axis is `dp_shard_cp` (cp ranks hold the same weights: FSDP shards over them too, as
        torchtitan does; ddp with tp > 1 then shards over cp alone)."""
        if self.dp_shard == 1 and (self.tp == 1 or self.dp_replicate * self.cp == 1):
            return ()
        shard = "dp_shard_cp" if self.cp > 1 else "dp_shard"
        return (shard,) if self.dp_replicate == 1 else ("dp_replicate", shard)


def ep_spans_tp(ep: int, dp: int, tp: int) -> bool:
    """parallel.ep's one rule, the tp half: an ep that does not divide dp takes whole tp groups when it is
    tp times a divisor of dp (Layout.experts_over_tp); any other ep that does not divide dp is refused."""
    return dp % ep != 0 and ep % tp == 0 and dp % (ep // tp) == 0


def expert_degree_error(ep: int, dp: int, tp: int) -> str:
    """The one line refusing an ep degree that neither divides dp nor is tp times a divisor of dp."""
    if tp == 1:
        return (
            f"parallel.ep ({ep}) must divide parallel.dp ({dp}): the experts are split over dp ranks; "
            f"set parallel.ep to a divisor of {dp}"
        )
    return (
        f"parallel.ep ({ep}) must divide parallel.dp ({dp}), or be parallel.tp ({tp}) times a divisor of it "
        "(whole tp groups borrowed with dp ranks); change parallel.ep"
    )


def place_text(coords: Mapping[str, float]) -> str:
    """A rank's coordinates as labels name them, `dp 0, tp 1, pp 1` (the layout's order); an axis a
    record does not hold (a run from before tp was recorded, cp where it does not split) is left
    out, not guessed."""
    return ", ".join(f"{axis} {int(coords[axis])}" for axis in PLACE_AXES if axis in coords)
