"""Pretrained safetensors weights, read per stage: each rank opens the files it needs and reads
only the tensors its stage owns (safetensors maps the file; nothing else is loaded).

A model names its tensors with `hf_names(name)`: the Hugging Face keys to try, in order (a tied
embedding may be stored as the input embedding or as lm_head; old GPT-2 files lack the
`transformer.` prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from meshrun.errors import ConfigError
from meshrun.files.json_reader import read_json
from meshrun.models.hf_config import INDEX, SINGLE, model_file


def has_weights(model_dir: Path) -> bool:
    return (model_dir / INDEX).is_file() or (model_dir / SINGLE).is_file()


def weight_index(model_dir: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the file holding it (sharded via the index json, or one file)."""
    from safetensors import safe_open

    if (model_dir / INDEX).is_file():
        try:
            weight_map = read_json(model_dir / INDEX)["weight_map"]
            entries = weight_map.items()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{model_dir / INDEX} is not a safetensors index (no weight_map): {exc}") from None
        index = {}
        for name, file in entries:  # named by the file: refused when it leads outside the folder
            model_file(model_dir, file, source=model_dir / INDEX)
            index[name] = model_dir / file
        return index
    try:
        with safe_open(model_dir / SINGLE, "pt", device="cpu") as f:
            return {name: model_dir / SINGLE for name in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad headers
        raise ConfigError(f"{model_dir / SINGLE} is not a readable safetensors file: {exc}") from None


def _locate(name: str, candidates: list[str], index: dict[str, Path], model_dir: Path) -> tuple[str, Path]:
    for key in candidates:
        if key in index:
            return key, index[key]
    raise ConfigError(
        f"model.hf {model_dir}: the weights have no tensor {candidates[0]} (for {name}); "
        "they do not belong to this config.json, or set model.init=random"
    )


def _by_file(
    module: nn.Module, hf_names: Callable[[str], list[str]], model_dir: Path
) -> dict[Path, list[tuple[str, str, torch.Tensor]]]:
    """(local name, file key, tensor) grouped by file, for every tensor `module` holds."""
    index = weight_index(model_dir)
    grouped: dict[Path, list[tuple[str, str, torch.Tensor]]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        key, file = _locate(name, hf_names(name), index, model_dir)
        grouped.setdefault(file, []).append((name, key, tensor))
    return grouped


def check_shapes(module: nn.Module, hf_names: Callable[[str], list[str]], model_dir: Path) -> None:
    """Every tensor the (meta) model needs exists in the files with the same shape; reads headers only."""
    from safetensors import safe_open

    for file, entries in _by_file(module, hf_names, model_dir).items():
        with safe_open(file, "pt", device="cpu") as f:
            for _name, key, tensor in entries:
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(tensor.shape):
                    raise ConfigError(
                        f"model.hf {model_dir}: tensor {key} in {file.name} has shape {list(shape)}, but config.json "
                        f"makes it {list(tensor.shape)}; the weights and config.json disagree"
                    )


@torch.no_grad()
def load_weights(module: nn.Module, hf_names: Callable[[str], list[str]], model_dir: Path) -> None:
    """Copy this module's tensors from the files, one tensor at a time (cast to the parameter dtype)."""
    from safetensors import safe_open

    for file, entries in _by_file(module, hf_names, model_dir).items():
        with safe_open(file, "pt", device="cpu") as f:
            for _, key, tensor in entries:
                tensor.copy_(f.get_tensor(key))
