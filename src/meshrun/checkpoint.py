"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, retained, reshardable.

Layout: `<run_dir>/checkpoints/step-00000010/` (DCP files, config.json, manifest.json) and
`latest` (a text file naming the newest).
Every saved value is a tensor keyed by its model-wide name, so any dp x pp layout can load any
other's checkpoint (DCP reshards; replicated dp copies are written once). A save goes to a
`.tmp` folder that rank 0 renames only after every rank finished writing, then `latest` moves.

Loading never unpickles arbitrary objects: tensors are read with `weights_only=True` by DCP, and
DCP's pickled `.metadata` index is read with an unpickler that admits only DCP's own classes.
A manifest of sizes and crc32s turns truncated or corrupt files into errors that name the file.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshrun.errors import RunError

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"  # file sizes and crc32s, written last: its presence marks a complete save
CONFIG = "config.json"  # the resolved config, so a checkpoint folder is self-describing
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RunError):
    """A checkpoint that cannot be read: names the file."""


# -- safe metadata -----------------------------------------------------------------------------

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` index is unpickled with an allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with path.open("rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"cannot read checkpoint index {path}: {exc}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# -- state ---------------------------------------------------------------------------------------

def model_state(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Model-wide names -> tensors for this rank's parts (wrappers stripped by DCP's helpers)."""
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    return state


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Flattened per-parameter optimizer tensors (`state.<param>.<exp_avg|exp_avg_sq|step>`).

    Hyper-parameters (param_groups) are left out: they come from the config and the step.
    """
    state: dict[str, torch.Tensor] = {}
    for part, optimizer in zip(parts, optimizers):
        flat = get_optimizer_state_dict(part, optimizer, options=_OPTIM_OPTIONS)
        state.update({k: v for k, v in flat.items() if k.startswith("state.")})
    return state


def load_optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], loaded: dict) -> None:
    for part, optimizer in zip(parts, optimizers):
        flat = get_optimizer_state_dict(part, optimizer, options=_OPTIM_OPTIONS)
        flat.update({k: loaded[k] for k in flat if k in loaded})
        set_optimizer_state_dict(part, optimizer, flat, options=_OPTIM_OPTIONS)


def load_model_state(parts: list[nn.Module], loaded: dict[str, torch.Tensor]) -> None:
    for part in parts:
        own = get_model_state_dict(part)
        set_model_state_dict(part, {k: loaded[k] for k in own})


# -- files ---------------------------------------------------------------------------------------

def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first (a `.tmp` folder is an interrupted save)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp") and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save(state: dict[str, torch.Tensor], run_dir: str | Path, step: int, *, keep: int, config: dict) -> Path:
    """Collective: every rank calls it with its own tensors. Returns the final folder."""
    root = checkpoint_root(run_dir)
    final = root / f"step-{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    rank0 = _rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a save that was killed
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    _barrier()  # every rank's shards are on disk before anyone hashes them
    sums = _gather({p.name: _crc32(p) for p in tmp.glob(f"__{_rank()}_*")})
    if rank0:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        files = {name: {"bytes": (tmp / name).stat().st_size, "crc32": crc} for part in sums for name, crc in part.items()}
        files.update({name: {"bytes": (tmp / name).stat().st_size, "crc32": _crc32(tmp / name)} for name in (".metadata", CONFIG)})
        _write_atomic(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / "latest", final.name)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def verify(path: Path) -> None:
    """Check every file against the manifest written at save time; the error names the file."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has no readable {MANIFEST} ({exc}); it is incomplete") from None
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is truncated or changed ({size} of {expected['bytes']} bytes)")
        if _crc32(file) != expected["crc32"]:
            raise CheckpointError(f"checkpoint file {file} is corrupt (checksum mismatch)")
    SafeReader(path).read_metadata()  # refuses anything but DCP's own classes


def load(state: dict[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """Fill `state` (tensors this rank needs, any layout) from the checkpoint at `path`.

    Rank 0 verifies the files first and every rank gets its verdict, so all ranks fail
    (or fall back) together.
    """
    path = Path(path)
    problem = [None]
    if _rank() == 0:
        try:
            verify(path)
        except CheckpointError as exc:
            problem[0] = str(exc)
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise CheckpointError(problem[0])
    try:
        with warnings.catch_warnings():  # single-process loads (export, tests) are intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(path), no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except Exception as exc:  # DCP wraps per-rank failures; name the folder for the user
        raise CheckpointError(f"cannot load checkpoint {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    return state


def full_model_state(model: nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """One process, no process group: the whole model's weights from a checkpoint of any layout."""
    state = {k: v for k, v in model.state_dict().items()}
    return load(state, path)


def resume_candidates(run_dir: str | Path, resume: str) -> list[Path]:
    """Checkpoints to try, newest first: an explicit path, or the run's complete ones (`auto`)."""
    if resume == "none":
        return []
    if resume != "auto":
        return [Path(resume)]
    return complete_checkpoints(run_dir)[::-1]


def saved_world_size(path: Path) -> int | None:
    """dp x pp of the job that wrote a checkpoint (None if its config is unreadable)."""
    try:
        parallel = json.loads((Path(path) / CONFIG).read_text())["parallel"]
        return int(parallel["dp"]) * int(parallel["pp"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_dir(run_or_checkpoint: str | Path) -> Path:
    """A checkpoint folder given itself or a run directory (its newest complete checkpoint)."""
    path = Path(run_or_checkpoint)
    if (path / MANIFEST).is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint folder nor a run directory with checkpoints")
    return found[-1]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
