"""One torchrun worker of tests/models/test_lora.py: a LoRA job trained as `meshrun train`'s workers
train it (training/worker.py: the mesh, the agreed precision, `Run`, `Trainer.train`), then what only
the live ranks can show: each base parameter's bytes after training (hashed whole: a tp shard is
gathered) and the mesh it is a DTensor on (None: a plain tensor), and each adapter's mesh. Writes
OUT/rank-R.json; the run directory is the job's, as the CLI leaves it (metrics, checkpoints).

python -m torch.distributed.run ... lora_worker.py OUT KEY=VALUE...
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from meshrun.config.schema import load_config
from meshrun.data.locations import data_dir
from meshrun.hardware.precision import with_resolved_precision
from meshrun.launcher.lifetime import end_worker
from meshrun.models.lora import is_adapter
from meshrun.parallel.mesh import init_mesh, shutdown
from meshrun.training.run import Run


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype)."""
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def held(run: Run) -> dict[str, dict]:
    """Every parameter this rank holds: its mesh's axis names (None: a plain tensor), and for the
    base its whole value's digest (every rank of a tp group gathers alike, in the same order)."""
    found = {}
    for part in run.trainer.model.parts:
        for wrapped, param in part.named_parameters():
            name = wrapped.replace("._checkpoint_wrapped_module", "")  # recompute's wrapper: as state dicts name it
            mesh = list(param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else None
            found[name] = {"mesh": mesh}
            if not is_adapter(name):
                found[name]["sha256"] = digest(param.full_tensor() if isinstance(param, DTensor) else param)
    return found


def main(out: Path, settings: list[str]) -> None:
    cfg = load_config(None, settings)
    mesh = init_mesh(cfg.layout)
    cfg = with_resolved_precision(cfg, mesh.device, speaks=False)
    run = Run(cfg, mesh, data_dir(cfg))
    try:
        run.trainer.train()
        found = held(run)
    finally:
        run.close()
    (out / f"rank-{mesh.rank}.json").write_text(json.dumps(found))
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    end_worker(0)  # as meshrun's workers end: gloo can abort a finished process at finalization
