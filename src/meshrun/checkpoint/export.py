"""A checkpoint consolidated into one file (`export --out`): `.safetensors` with the config in its
metadata, or a plain `.pt` dict that loads with weights_only (the CLI checks the target first:
`cli.arguments.check_export_target`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from meshrun.config.schema import Config
from meshrun.errors import ConfigError, RunError
from meshrun.files.atomic import atomic_target


def export(model: nn.Module, cfg: Config, folder: Path, out: str | Path) -> Path:
    """Write the loaded model of checkpoint `folder` as one file: `.safetensors` (config in its
    metadata) or `.pt` (a plain dict, weights_only-loadable)."""
    out = Path(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = json.dumps(cfg.model_dump(mode="json"))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_target(out, replace=False) as tmp:  # never over a file; a failure removes only its own
            if out.suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file(state, str(tmp), metadata={"meshrun_config": config, "checkpoint": folder.name})
            else:
                torch.save({"model": state, "meshrun_config": config}, tmp)
    except RunError:
        raise  # a full disk: one line naming it
    except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' own error for the same causes
        raise ConfigError(
            f"--out {out} cannot be written ({' '.join(str(exc).split())}); choose another --out"
        ) from None
    return out
