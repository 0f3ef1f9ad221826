"""How a job is laid out over processes: the `parallel` and `launch` config sections, and the
rules across sections that need only the config (the batch over ranks and micro-steps, workers
over nodes, profiled ranks that exist). Pure and torch-free. `Config`'s model validator runs
`check_layout`, so every Config is checked however it was built (YAML, `--set`, code, a
checkpoint's config.json); `meshrun slurm` splits its `--nodes` with the same `workers_per_node`.
Whether the pipeline can be cut (blocks per stage, a schedule's microbatches) depends on the
model's depth, maybe read from a Hugging Face folder: `preflight` checks that (with `plan.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from meshrun.config.address import host_problem, port_problem, split_endpoint
from meshrun.config.fields import Int, Section, lowercase
from meshrun.errors import ConfigError
from meshrun.parallel.layout import Layout, ep_spans_tp, expert_degree_error

Schedule = Annotated[
    Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv"], BeforeValidator(lowercase)
]
Balance = Annotated[Literal["even", "time", "size"], BeforeValidator(lowercase)]
DpMode = Annotated[Literal["ddp", "fsdp", "hsdp"], BeforeValidator(lowercase)]
Recovery = Annotated[Literal["checkpoint", "peer"], BeforeValidator(lowercase)]
ShardDtype = Annotated[Literal["fp32", "bf16", "fp16"], BeforeValidator(lowercase)]


class ParallelConfig(Section):
    dp: Int = Field(default=1, ge=1)
    """Data-parallel degree (ranks per pipeline stage; see dp_mode)."""
    pp: Int = Field(default=1, ge=1)
    """Pipeline-parallel degree (stages over Transformer blocks)."""
    cp: Int = Field(default=1, ge=1)
    """Context-parallel degree: each sequence's positions split over cp ranks (contiguous chunks), all positions of heads / cp of the heads inside attention (all-to-all, Ulysses style; docs/guides/long-context.md)."""
    tp: Int = Field(default=1, ge=1)
    """Tensor-parallel degree: each layer's matrices split over tp neighbouring ranks of one node (DTensor)."""
    sequence_parallel: bool = False
    """tp > 1: also split norms' and dropout's activations by sequence over the tp ranks (Megatron's; model.seq_len divisible by tp)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule from torch.distributed.pipelining (used when pp > 1)."""
    virtual_stages: Int | None = Field(default=None, ge=1)
    """Stages per rank: 1 for gpipe/1f1b; 2 for zbv; default 2 for interleaved-1f1b, looped-bfs and zero-bubble."""
    stage_layers: list[list[Int]] | None = None
    """Explicit blocks per stage, e.g. [[0, 1, 2], [3]]; overrides `balance`."""
    balance: Balance = "even"
    """How to split blocks: even (embedding and head weigh one block each), or measured time / size (fairscale)."""
    dp_mode: DpMode = "ddp"
    """Data parallelism: ddp (full replicas), fsdp (FSDP2: params, grads, optimizer state sharded over dp), hsdp (sharded within dp_shard ranks, replicated across)."""
    dp_shard: Int | None = Field(default=None, ge=1)
    """hsdp only: ranks one copy is sharded over (a divisor of dp, e.g. GPUs per node); dp / dp_shard replicas."""
    fsdp_reshard_after_forward: bool | None = None
    """fsdp/hsdp: free gathered params after each forward; None = yes without a pipeline, no under pp (gather once per step)."""
    fsdp_param_dtype: ShardDtype = "fp32"
    """fsdp/hsdp: dtype params are all-gathered and computed in (fp32 = autocast alone decides, as with ddp)."""
    fsdp_reduce_dtype: ShardDtype = "fp32"
    """fsdp/hsdp: dtype gradients are reduce-scattered in (fp32 sums exactly as ddp's all-reduce does)."""
    ep: Int = Field(default=1, ge=1)
    """Expert parallelism: each MoE layer's experts split over this many of a stage's ranks (tokens travel to their experts' ranks and back by all-to-all): a divisor of dp borrows dp ranks (under tp each MoE block whole on every tp rank); otherwise tp times a divisor of dp, which borrows whole tp groups too (each tp rank routes its own share of the tokens). The ranks holding the same experts average their gradients."""

    @model_validator(mode="after")
    def _shard_divides_dp(self) -> ParallelConfig:
        """parallel.dp_shard only with dp_mode hsdp, where it is needed: a divisor of dp between 2 and dp / 2."""
        if self.dp_mode != "hsdp":
            if self.dp_shard is not None:
                raise ValueError(
                    f"parallel.dp_shard is for dp_mode hsdp (dp_mode is {self.dp_mode}); remove it or set parallel.dp_mode=hsdp"
                )
            return self
        if self.dp_shard is None or self.dp % self.dp_shard or not 1 < self.dp_shard < self.dp:
            raise ValueError(
                f"dp_mode hsdp needs parallel.dp_shard, a divisor of parallel.dp ({self.dp}) between 2 and dp/2 "
                f"(got {self.dp_shard}); set it, or use dp_mode fsdp to shard over all dp ranks"
            )
        return self

    @model_validator(mode="after")
    def _ep_borrows_dp(self) -> ParallelConfig:
        """parallel.ep divides parallel.dp (the dp ranks it borrows; under tp > 1 each MoE block stays whole
        on every tp rank), or is parallel.tp times a divisor of dp (it borrows whole tp groups too)."""
        if self.dp % self.ep and not ep_spans_tp(self.ep, self.dp, self.tp):
            raise ValueError(expert_degree_error(self.ep, self.dp, self.tp))
        return self

    @model_validator(mode="after")
    def _settings_that_apply(self) -> ParallelConfig:
        """A setting of a mode this layout does not use is refused, not silently ignored."""
        if self.pp == 1 and (self.virtual_stages or 1) > 1:
            raise ValueError("parallel.virtual_stages is for a pipeline (pp is 1); remove it or set parallel.pp > 1")
        if self.pp == 1 and self.stage_layers is not None and len(self.stage_layers) > 1:
            raise ValueError(
                f"parallel.stage_layers lists {len(self.stage_layers)} stages but pp is 1; remove it or set parallel.pp"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel splits activations over the tp ranks but tp is 1; remove it or set parallel.tp > 1"
            )
        if self.dp_mode == "ddp":
            unused = [f"fsdp_{n}" for n in ("param_dtype", "reduce_dtype") if getattr(self, f"fsdp_{n}") != "fp32"]
            unused += ["fsdp_reshard_after_forward"] if self.fsdp_reshard_after_forward is not None else []
            if unused:
                raise ValueError(
                    f"parallel.{unused[0]} is for dp_mode fsdp/hsdp (dp_mode is ddp); remove it or set parallel.dp_mode=fsdp"
                )
        return self


class LaunchConfig(Section):
    max_restarts: Int = Field(default=0, ge=0)
    """torchrun restarts of the whole worker group after a failure; each restart resumes from the newest checkpoint."""
    nnodes: Int = Field(default=1, ge=1)
    """Nodes in the job, one torchrun agent (one `meshrun train`) each; > 1 needs `rdzv_endpoint`."""
    nproc_per_node: Int | None = Field(default=None, ge=1)
    """Workers on each node; None = parallel.dp x parallel.tp x parallel.pp / nnodes."""
    rdzv_endpoint: str | None = None
    """HOST[:PORT] of the c10d rendezvous on the host node (port default 29400); None on one node = a free local port."""
    rdzv_id: str = "meshrun"
    """Id shared by all nodes of one job (e.g. $SLURM_JOB_ID); jobs sharing an endpoint need different ids."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it (torchrun --local-addr); None = its host name."""
    host_node: bool | None = None
    """Whether this node hosts the rendezvous store (c10d is_host); None = torchrun guesses from rdzv_endpoint."""
    rdzv_timeout: Int = Field(default=600, ge=1)
    """Seconds a node waits at the rendezvous for all `nnodes` nodes before it gives up (torchrun join_timeout); under recovery peer also how long the survivors wait for a lost rank's replacement (a lost node's command run again)."""
    hang_timeout: Int = Field(default=600, ge=0)
    """Seconds a worker may make no progress before the job is ended with a hang report (x3 while it initialises, in its first step, evaluation and checkpoints); 0 = never."""
    recovery: Recovery = "checkpoint"
    """How a lost worker is recovered: checkpoint (torchrun restarts every worker from the newest checkpoint), or peer (only the lost worker is replaced, up to max_restarts times per rank, and takes its state from a surviving dp replica's memory: no step lost; ddp with pipelines of schedule 1f1b, hsdp without, one node or several (a node lost whole comes back as replacements when its `meshrun train` runs again, within rdzv_timeout; not the host node), CPU/gloo so far; dp 1 and fsdp, where no rank holds another's state, fall back to checkpoint)."""
    warm_spare: bool = False
    """recovery peer: keep each rank's next replacement started ahead, its imports done, waiting (a replacement takes ~0.1 s instead of a process start; an idle process per rank)."""

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, endpoint: str | None) -> str | None:
        """HOST[:PORT] as torchrun parses it, checked here rather than in a torchrun traceback."""
        if endpoint is None:
            return None
        host, port = split_endpoint(endpoint)
        if problem := host_problem(host):
            raise ValueError(f"use HOST[:PORT] with PORT 1-65535 (got {endpoint!r}: host {host!r} {problem})")
        if port is not None and (problem := port_problem(port)):
            raise ValueError(f"use HOST[:PORT] with PORT 1-65535 (got {endpoint!r}: {port!r} {problem})")
        return endpoint

    @field_validator("local_addr")
    @classmethod
    def _address(cls, addr: str | None) -> str | None:
        """An address torch would retry until its timeout is refused here."""
        problem = host_problem(addr) if addr is not None else None
        if problem:
            raise ValueError(f"{addr!r} {problem}; use this node's host name or address")
        return addr

    @model_validator(mode="after")
    def _multi_node_needs_endpoint(self) -> LaunchConfig:
        """More than one node needs launch.rdzv_endpoint: where the nodes meet."""
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"launch.nnodes is {self.nnodes}, so launch.rdzv_endpoint (HOST:PORT on the host node) is needed; "
                "pass --rdzv-endpoint"
            )
        return self


def check_layout(
    par: ParallelConfig,
    launch: LaunchConfig,
    *,
    global_batch: int,
    micro_batch: int,
    profiled_ranks: Sequence[int],
    tp_splits: Mapping[str, int],
    sequences: Mapping[str, int],
) -> None:
    """Every rule over several sections that needs only the config's numbers (`tp_splits`: the
    model's sizes tensor parallelism divides, by the key that sets each)."""
    check_batch_maths(par, global_batch=global_batch, micro_batch=micro_batch)
    check_nodes(par, launch)
    check_recovery(par, launch)
    check_profiled_ranks(par, profiled_ranks)
    check_tensor_split(par, tp_splits, sequences=sequences)


def check_tensor_split(par: ParallelConfig, splits: Mapping[str, int], *, sequences: Mapping[str, int]) -> None:
    """Each size a tp shard holds a part of (whole heads; the sequences, by the key that sets each,
    under sequence parallel or where parallel.ep spans tp: each tp rank routes its positions) divides by
    parallel.tp."""
    for key, size in splits.items():
        if size % par.tp:
            raise ConfigError(f"{key} ({size}) must be divisible by parallel.tp ({par.tp}); change one of these keys")
    over_tp = Layout.of(par).experts_over_tp
    for key, length in sequences.items() if par.sequence_parallel or over_tp else ():
        if length % par.tp:
            why, fix = (
                ("parallel.sequence_parallel", "set parallel.sequence_parallel=false")
                if par.sequence_parallel
                else (f"parallel.ep {par.ep} spanning tp", f"set parallel.ep to a divisor of parallel.dp ({par.dp})")
            )
            raise ConfigError(
                f"{key} ({length}) must be divisible by parallel.tp ({par.tp}) under {why}; "
                f"change one of these keys or {fix}"
            )


def check_batch_maths(par: ParallelConfig, *, global_batch: int, micro_batch: int) -> None:
    """Refuse batch sizes that do not split evenly over data-parallel ranks and micro-steps."""
    if global_batch % (micro_batch * par.dp):
        raise ConfigError(
            f"train.global_batch ({global_batch}) must be a multiple of train.micro_batch x parallel.dp "
            f"({micro_batch} x {par.dp} = {micro_batch * par.dp}); change one of these keys"
        )


def check_nodes(par: ParallelConfig, launch: LaunchConfig) -> None:
    """Refuse node counts that do not split dp x pp workers evenly, and tp groups that would span nodes."""
    if launch.nproc_per_node is None:
        per_node = workers_per_node(par, launch.nnodes, named=f"launch.nnodes ({launch.nnodes})", change="--nnodes")
        if per_node % par.tp:
            raise ConfigError(
                f"parallel.tp ({par.tp}) must divide the workers per node ({per_node} = world size / "
                f"launch.nnodes {launch.nnodes}): a tp group stays on one node; change parallel.tp or launch.nnodes"
            )
    elif launch.nnodes * launch.nproc_per_node != (layout := Layout.of(par)).world_size:
        raise ConfigError(
            f"launch.nnodes x launch.nproc_per_node ({launch.nnodes} x {launch.nproc_per_node}) must equal "
            f"{layout.world_text()}; change one of these keys"
        )
    elif launch.nproc_per_node % par.tp:
        raise ConfigError(
            f"parallel.tp ({par.tp}) must divide launch.nproc_per_node ({launch.nproc_per_node}): "
            "a tp group stays on one node; change one of these keys"
        )


def peer_recovery(par: ParallelConfig, launch: LaunchConfig) -> bool:
    """Whether a lost worker is replaced from a replica (launch.recovery peer with a replica to copy:
    more than one dp_replicate, as ddp at dp > 1 and hsdp have); otherwise (dp 1, or fsdp, where each
    shard is on one rank only) torchrun restarts every worker from the newest checkpoint."""
    return launch.recovery == "peer" and Layout.of(par).dp_replicate > 1


def no_replica(par: ParallelConfig) -> str:
    """Why no replica holds a lost worker's state, where `peer_recovery` falls back (said at launch)."""
    if par.dp == 1:
        return "dp is 1"
    return f"parallel.dp_mode {par.dp_mode} shards each rank's state over all {par.dp} dp ranks, none holds another's"


def check_recovery(par: ParallelConfig, launch: LaunchConfig) -> None:
    """launch.recovery peer only where it is built (ddp data parallel with pipelines of schedule 1f1b
    split without measuring, or hsdp without pipelines; on any number of nodes) and has replacements to give."""
    if launch.warm_spare and launch.recovery != "peer":
        raise ConfigError("launch.warm_spare is for launch.recovery peer; remove it or set launch.recovery peer")
    if not peer_recovery(par, launch):
        return
    unbuilt = [f"parallel.{key} is {getattr(par, key)}" for key in ("tp", "cp", "ep") if getattr(par, key) > 1]
    if par.pp > 1 and par.dp_mode != "ddp":  # hsdp: built and tested without pipelines only
        unbuilt += [f"parallel.dp_mode is {par.dp_mode} with parallel.pp {par.pp}"]
    elif par.pp > 1:  # a replacement builds its stage as the others did, asking them nothing (no measured split)
        unbuilt += [f"parallel.schedule is {par.schedule}"] if par.schedule != "1f1b" else []
        measured = par.balance != "even" and par.stage_layers is None
        unbuilt += [f"parallel.balance is {par.balance}"] if measured else []
    if unbuilt:
        raise ConfigError(
            "launch.recovery peer is built for ddp data parallel with pipelines of schedule 1f1b split evenly or "
            f"by parallel.stage_layers, and hsdp without pipelines, so far ({unbuilt[0]}); "
            "use launch.recovery checkpoint"
        )
    if launch.max_restarts == 0:
        raise ConfigError(
            "launch.recovery peer replaces a lost worker at most launch.max_restarts times per rank (it is 0); "
            "set launch.max_restarts (--max-restarts) to 1 or more"
        )


def refuse_peer_recovery(par: ParallelConfig, launch: LaunchConfig, command: str) -> None:
    """launch.recovery peer needs a keeper for each worker (launcher/keeper.py), which `meshrun train`'s
    torchrun launch starts (launcher/torchrun.py; also each node's under Slurm), and a pod restarted
    by Kubernetes cannot join a running group as a replacement yet."""
    if peer_recovery(par, launch):
        raise ConfigError(
            f"launch.recovery peer runs under `meshrun train` and `meshrun slurm` so far, not `{command}`; "
            "use launch.recovery checkpoint"
        )


def check_profiled_ranks(par: ParallelConfig, ranks: Sequence[int]) -> None:
    """profile.ranks name ranks of this layout."""
    layout = Layout.of(par)
    stray = [rank for rank in ranks if rank >= layout.world_size]
    if stray:
        raise ConfigError(
            f"profile.ranks {stray} do not exist: ranks are 0 to {layout.world_size - 1} "
            f"({layout.axes_text()} = {layout.world_size}); change profile.ranks"
        )


def workers_per_node(par: ParallelConfig, nodes: int, *, named: str, change: str) -> int:
    """dp x pp x tp workers split evenly over `nodes` (`named` and `change` say where the count was set)."""
    layout = Layout.of(par)
    if nodes < 1 or layout.world_size % nodes:
        raise ConfigError(f"{named} must divide {layout.world_text()}; change {change} or the parallel degrees")
    return layout.world_size // nodes
