"""Peer recovery under HSDP (launch.recovery peer, parallel.dp_mode hsdp; issue 46): a survivor's
FSDP2 state carried over to the next generation of the process group.

FSDP2 binds a rank's shards to the data mesh: its parameters and AdamW moments are DTensors of that
mesh, and each parameter group keeps the mesh's process groups (torch 2.13's private FSDPMeshInfo,
read once at `fully_shard`). The regroup destroys those groups, and torch has no API that moves an
FSDP2 module to another mesh. So a survivor does not rebind its modules: it keeps its local shards
as plain tensors (the same memory, no copy), forgets the modules (a gloo group's connections close
only once nothing holds it: a peer blocked on this rank in one then notices the loss), and once the
next generation is joined builds its state again as a replacement does (training/state.py's
`build_state`: `fully_shard` over the new data mesh, the same collectives in the same order) and
copies its shards in. No private torch API beyond regroup.release's. The rank a replacement takes
its shard from is then a rank of another replica at the same shard index, the lowest surviving one
of its `dp_replicate` group (training/recovery.py's `share_state`).

FSDP alone (dp_replicate 1) has no such rank: every shard is on one rank only, and peer recovery
falls back to checkpoint restarts (config/topology.py's `peer_recovery`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshrun.config.schema import Config
from meshrun.parallel.fsdp import local
from meshrun.parallel.mesh import Mesh
from meshrun.training.state import TrainState, build_state

if TYPE_CHECKING:
    from meshrun.training.trainer import Trainer


def rebuilds(mesh: Mesh) -> bool:
    """Whether a survivor's state is built again over the new meshes (FSDP2's, bound to its mesh)
    rather than its DDP wrappers made again around the same modules."""
    return mesh.data_mesh is not None


@torch.no_grad()
def kept_shards(trainer: Trainer, step: int) -> dict[str, torch.Tensor]:
    """This survivor's state at `step` (TrainState.state_dict's names, RNG left out) as plain
    tensors sharing its shards' memory; the trainer's state, and with it every FSDP2 module that
    holds the broken group's process groups, forgotten."""
    kept = {key: local(tensor).detach() for key, tensor in trainer.state.state_dict(step, rng=False).items()}
    trainer.drop_state()
    return kept


@torch.no_grad()
def rebuilt(cfg: Config, mesh: Mesh, kept: dict[str, torch.Tensor]) -> TrainState:
    """Collective (build_state's, as a replacement's Run makes them): this survivor's state built
    over `mesh`, holding the shards `kept_shards` kept."""
    state = build_state(cfg, mesh)
    named = state.state_dict(int(kept["progress.step"]), rng=False)
    for key, tensor in named.items():
        local(tensor).copy_(kept[key])
    state.load_state_dict(named)
    return state
