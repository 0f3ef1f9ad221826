"""The only reader meshrun loads checkpoints with: DCP's pickled `.metadata` index is unpickled with
an allowlist of DCP's own classes for what meshrun writes (tensor entries). A bytes entry (which
DCP's planner would `torch.load` with `weights_only=False`) or a transformed (compressed) one is
refused with the index's name, and so is a tensor its chunks do not tile (checkpoint/chunk_tiling.py);
tensors themselves are read by DCP with `weights_only=True`."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from meshrun.checkpoint.chunk_tiling import tiling_problem
from meshrun.errors import CheckpointError

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
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
        if name == "BytesStorageMetadata":  # DCP would torch.load the item with weights_only=False
            raise pickle.UnpicklingError(
                "it declares a pickled (non-tensor) item, which meshrun never writes and never unpickles"
            )
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` index is unpickled with an allowlist and holds only
    entries of the kind meshrun writes (untransformed tensors): the only reader meshrun loads with."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with path.open("rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            raise CheckpointError(f"cannot read checkpoint index {path}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - an allowed class called with forged arguments: any error
            raise CheckpointError(f"cannot read checkpoint index {path}: {type(exc).__name__}: {exc}") from None
        if not isinstance(metadata, dcp.Metadata) or not isinstance(metadata.storage_data, dict):
            raise CheckpointError(f"cannot read checkpoint index {path}: it is not a DCP index")
        transformed = [getattr(info, "transform_descriptors", None) for info in metadata.storage_data.values()]
        if any(transformed):  # DCP would decompress each whole into memory, unbounded; meshrun writes none
            raise CheckpointError(
                f"checkpoint index {path} names transformed (compressed) entries "
                f"{next(filter(None, transformed))}, which meshrun never writes"
            )
        if problem := tiling_problem(metadata, Path(self.path)):  # DCP would load it, part of a tensor missing
            raise CheckpointError(f"checkpoint index {path}: {problem}; it is damaged or was not written by meshrun")
        meta = metadata.storage_meta
        meta = meta if isinstance(meta, dcp.metadata.StorageMeta) else dcp.metadata.StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata
