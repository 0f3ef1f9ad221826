"""Pretrained safetensors weights, read per stage: each rank opens the files it needs and reads
only the tensors its stage owns (safetensors maps the file; nothing else is loaded).

A model hands its tensors grouped as the files hold them (`tensors`: our name -> the tensors whose
rows, in order, make that file tensor: one, or a fused projection's parts, or a rank's experts of a
3-D experts tensor between meta placeholders for the rows other ranks hold) and names them with
`hf_names(name)`: the Hugging Face keys to try, in order (a tied embedding may be stored as the
input embedding or as lm_head; old GPT-2 files lack the `transformer.` prefix).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshrun.config.model_sections import HFSection
from meshrun.errors import ConfigError
from meshrun.files.json_reader import read_json
from meshrun.models.hf_config import INDEX, SINGLE, hf_dir, model_file


def has_weights(model_dir: Path) -> bool:
    return (model_dir / INDEX).is_file() or (model_dir / SINGLE).is_file()


def pretrained_folder(cfg: HFSection) -> Path | None:
    """The model folder whose weights a model starts from, per `model.init` (None: a seeded init)."""
    path = hf_dir(cfg)
    if cfg.init == "random":
        return None
    if path is None or not has_weights(path):
        if cfg.init == "pretrained":
            where = f"model.hf {cfg.hf} has no model.safetensors" if path else "model.hf_config has no weights"
            raise ConfigError(f"model.init is pretrained but {where}; set model.init=random or add the weights")
        return None
    return path


DIGEST_WINDOW = 4096  # bytes read at each end of every tensor by weights_digest
MAX_HEADER = 100 << 20  # a safetensors header's largest size (safetensors' own bound)


def weights_digest(model_dir: Path) -> str:
    """sha256 of what a folder's weights are, read cheaply (a few KiB per tensor, not the whole
    folder): config.json, then per weight file its name, size and safetensors header (every tensor's
    name, dtype, shape and offsets) and the first and last 4 KiB of every tensor's bytes. Another
    model, shape or dtype changes the header; another fine-tune of the same model changes nearly
    every byte of the tensors it touched, so it changes their windows too."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in sorted(set(weight_index(model_dir).values())):
        size = file.stat().st_size
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            if length > min(size - 8, MAX_HEADER):
                raise ConfigError(f"{file} is not a readable safetensors file (header of {length} bytes)")
            header = f.read(length)
            digest.update(f"{file.name}\0{size}\0".encode() + header)
            try:
                spans = [
                    e["data_offsets"]
                    for e in json.loads(header).values()
                    if isinstance(e, dict) and "data_offsets" in e
                ]
                for begin, end in ((8 + length + int(a), 8 + length + int(b)) for a, b in spans):
                    for at in (begin, max(begin, end - DIGEST_WINDOW)):
                        f.seek(at)
                        digest.update(f.read(max(0, min(DIGEST_WINDOW, end - at))))
            except (ValueError, TypeError, AttributeError, OverflowError, OSError) as exc:  # offsets a file made up
                raise ConfigError(f"{file} is not a readable safetensors file: {exc}") from None
    return digest.hexdigest()


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


Tensors = dict[str, list[torch.Tensor]]
"""Our name -> the tensors whose rows, in order, make one tensor of the files."""


def _by_file(
    tensors: Tensors, hf_names: Callable[[str], list[str]], model_dir: Path
) -> dict[Path, list[tuple[str, list[torch.Tensor]]]]:
    """(file key, our tensors) grouped by file."""
    index = weight_index(model_dir)
    grouped: dict[Path, list[tuple[str, list[torch.Tensor]]]] = {}
    for name, parts in tensors.items():
        key, file = _locate(name, hf_names(name), index, model_dir)
        grouped.setdefault(file, []).append((key, parts))
    return grouped


def _joined_shape(parts: list[torch.Tensor]) -> tuple[int, ...]:
    if len(parts) == 1:
        return tuple(parts[0].shape)
    return (sum(p.shape[0] for p in parts), *parts[0].shape[1:])


def elsewhere(rows: int, like: torch.Tensor) -> torch.Tensor:
    """A placeholder for `rows` rows of a file tensor this stage does not hold (another ep rank's
    experts): on the meta device, so it has a shape and no bytes; loading skips it."""
    return torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device="meta")


def _checked_shape(f: Any, key: str, parts: list[torch.Tensor], file: Path, model_dir: Path) -> None:
    shape, ours = tuple(f.get_slice(key).get_shape()), _joined_shape(parts)
    if shape != ours:
        raise ConfigError(
            f"model.hf {model_dir}: tensor {key} in {file.name} has shape {list(shape)}, but config.json "
            f"makes it {list(ours)}; the weights and config.json disagree"
        )


def check_shapes(tensors: Tensors, hf_names: Callable[[str], list[str]], model_dir: Path) -> None:
    """Every tensor the (meta) model needs exists in the files with the same shape; reads headers only."""
    from safetensors import safe_open

    for file, entries in _by_file(tensors, hf_names, model_dir).items():
        with safe_open(file, "pt", device="cpu") as f:
            for key, parts in entries:
                _checked_shape(f, key, parts, file, model_dir)


STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # safetensors' names


def stored_dtypes(tensors: Tensors, hf_names: Callable[[str], list[str]], model_dir: Path) -> dict[int, torch.dtype]:
    """id(our tensor) -> the float dtype the files store it in (reads headers only); a tensor stored
    in another dtype (fp64, an integer) is left out."""
    from safetensors import safe_open

    dtypes: dict[int, torch.dtype] = {}
    for file, entries in _by_file(tensors, hf_names, model_dir).items():
        with safe_open(file, "pt", device="cpu") as f:
            for key, parts in entries:
                stored = STORED_DTYPES.get(f.get_slice(key).get_dtype())
                dtypes |= {id(part): stored for part in parts if stored is not None}
    return dtypes


@torch.no_grad()
def load_weights(tensors: Tensors, hf_names: Callable[[str], list[str]], model_dir: Path) -> None:
    """Copy our tensors from the files (cast to the parameter dtype), each from its own rows of its
    file tensor (`get_slice`: a fused projection's parts, a rank's experts of a 3-D tensor), so no
    other rows are read or allocated; the shape is checked against the header first. Meta parts
    (`elsewhere`) are rows this stage does not hold: skipped."""
    from safetensors import safe_open

    for file, entries in _by_file(tensors, hf_names, model_dir).items():
        with safe_open(file, "pt", device="cpu") as f:
            for key, parts in entries:
                _checked_shape(f, key, parts, file, model_dir)
                if len(parts) == 1:
                    parts[0].copy_(f.get_tensor(key))
                    continue
                start = 0
                for part in parts:
                    if not part.is_meta:
                        part.copy_(f.get_slice(key)[start : start + part.shape[0]])
                    start += part.shape[0]
