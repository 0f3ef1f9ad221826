"""What a checkpoint holds of a run: the model's parts on this rank, their optimizers, fp16's loss
scaler and the counters that say where the run is, as named tensors and back."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from meshrun.checkpoint import dcp as checkpoint
from meshrun.config.schema import Config
from meshrun.hardware.precision import autocast, make_scaler
from meshrun.models.lora import base_identity, is_adapter
from meshrun.parallel.mesh import Mesh
from meshrun.parallel.parallelize import LocalModel, parallelize
from meshrun.training.loss import MicrobatchLoss
from meshrun.training.optim import Optimizers

if TYPE_CHECKING:
    from meshrun.parallel.pipeline import PipelineModel


class TrainState:
    """The model, its optimizers and scaler, and the data position and skipped steps (which the
    trainer moves on), as this rank saves and loads them. `base`: a LoRA run's frozen base folder
    (models.lora.base_identity): the model state saved and loaded is then the adapters' only."""

    def __init__(
        self,
        model: LocalModel | PipelineModel,
        optimizers: Optimizers,
        scaler: GradScaler | None,
        *,
        mesh: Mesh,
        base: dict[str, str] | None = None,
    ) -> None:
        self.model, self.optimizers, self.scaler, self.base = model, optimizers, scaler, base
        self.rank, self.device = mesh.rank, mesh.device
        self.samples_seen = 0  # data position in global samples: survives a change of dp
        self.skipped_steps = 0  # fp16 steps the scaler skipped, over the whole run (checkpointed)

    def state_dict(self, step: int, *, rng: bool = True) -> dict[str, torch.Tensor]:
        """Everything needed to continue exactly, as named tensors (see checkpoint.py).

        RNG states (dropout) are per rank: they are restored only into the same dp, tp and pp.
        """
        state = {
            **checkpoint.model_state(self.model.parts, keep=is_adapter if self.base is not None else None),
            **checkpoint.optimizer_state(self.model.parts, self.optimizers.optimizers),
            "progress.step": torch.tensor(step),
            "progress.samples_seen": torch.tensor(self.samples_seen),
            "progress.skipped_steps": torch.tensor(self.skipped_steps),
        }
        if self.scaler is not None:
            state["scaler.scale"] = torch.tensor(self.scaler.get_scale(), dtype=torch.float64)
            state["scaler.growth_tracker"] = torch.tensor(self.scaler.state_dict()["_growth_tracker"])
        if rng:
            state[f"rng.{self.rank}.cpu"] = torch.get_rng_state()
            if self.device.type == "cuda":
                state[f"rng.{self.rank}.cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        checkpoint.load_model_state(self.model.parts, state, strict=self.base is None)
        checkpoint.load_optimizer_state(self.model.parts, self.optimizers.optimizers, state)
        self.samples_seen = int(state["progress.samples_seen"])
        self.skipped_steps = int(state["progress.skipped_steps"])
        if f"rng.{self.rank}.cpu" in state:
            torch.set_rng_state(state[f"rng.{self.rank}.cpu"])
        if f"rng.{self.rank}.cuda" in state:
            torch.cuda.set_rng_state(state[f"rng.{self.rank}.cuda"], self.device)
        if self.scaler is not None:
            self.scaler.load_state_dict(
                {
                    **self.scaler.state_dict(),
                    "scale": float(state["scaler.scale"]),
                    "_growth_tracker": int(state["scaler.growth_tracker"]),
                }
            )


def build_state(cfg: Config, mesh: Mesh) -> TrainState:
    """This rank's model (built, split, initialised or loaded), its optimizers and scaler, at step 0."""
    # Dropout streams (weights and data have their own seeds): one per tp group (Layout.seed_offset),
    # as tp ranks hold the same activations outside the split matrices and must drop the same ones
    # (where they hold different ones, parallel/tp_rng.py seeds a stream per tp rank from this one).
    torch.manual_seed(cfg.train.seed + mesh.seed_offset)
    # Steps and evaluations pass their own loss (batch_loss); this one only sets the microbatch count.
    model = parallelize(cfg, mesh, loss=MicrobatchLoss(cfg.accumulation_steps), amp=partial(autocast, cfg, mesh.device))
    # fsdp/hsdp: each rank checks only its gradient shards, so every rank must agree on found_inf
    # (and tp: each rank checks its shards)
    sharded = mesh.data_mesh is not None or mesh.size("tp") > 1
    optimizers = Optimizers(model.parts, cfg.train)
    scaler = make_scaler(cfg, mesh.device, dist.group.WORLD if sharded else mesh.group("pp"))
    return TrainState(model, optimizers, scaler, mesh=mesh, base=base_identity(cfg.model))
